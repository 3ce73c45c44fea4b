// CPU DequantizeInto: used by tests and by any caller on the CPU (routing
// never sends CPU attention through it; mlxq's CPU kernel reads codes).
#include <cmath>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

#include "debug.h"
#include "dequantize_into.h"

namespace mlxq {

namespace {

template <typename T>
float element(const mx::array& a, int64_t offset) {
  return static_cast<float>(a.data<T>()[offset]);
}

float load(const mx::array& a, int64_t offset) {
  switch (a.dtype()) {
    case mx::float16:
      return element<mx::float16_t>(a, offset);
    case mx::bfloat16:
      return element<mx::bfloat16_t>(a, offset);
    default:
      return element<float>(a, offset);
  }
}

int64_t offset3(const mx::array& a, int64_t b, int64_t h, int64_t n) {
  const auto& st = a.strides();
  return b * st[0] + h * st[1] + n * st[2];
}

template <typename T>
void dequantize_rows(
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    T* dst,
    int group_size,
    int bits) {
  const int B = packed.shape(0), H = packed.shape(1), N = packed.shape(2);
  const int D = packed.shape(3) * 32 / bits, G = D / group_size;
  const uint32_t mask = (1u << bits) - 1u;
  const uint32_t* words = packed.data<uint32_t>();
  const int64_t w_step = packed.strides()[3];
  const int64_t s_step = scales.strides()[3], b_step = biases.strides()[3];
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int n = 0; n < N; ++n) {
        const uint32_t* row = words + offset3(packed, b, h, n);
        const int64_t so = offset3(scales, b, h, n), bo = offset3(biases, b, h, n);
        for (int g = 0; g < G; ++g) {
          const float s = load(scales, so + g * s_step);
          const float z = load(biases, bo + g * b_step);
          for (int i = g * group_size; i < (g + 1) * group_size; ++i) {
            const int bit = i * bits, w = bit >> 5, off = bit & 31;
            uint64_t window = row[w * w_step];
            if (off + bits > 32) {
              window |= uint64_t(row[(w + 1) * w_step]) << 32;
            }
            const float code = static_cast<float>((window >> off) & mask);
            *dst++ = static_cast<T>(std::fma(s, code, z));
          }
        }
      }
    }
  }
}

} // namespace

void DequantizeInto::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  if (!detail::share_workspace(inputs[0], out)) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([packed = inputs[1],
                scales = inputs[2],
                biases = inputs[3],
                out = mx::array::unsafe_weak_copy(out),
                gs = group_size_,
                bits = bits_]() mutable {
    // Poisoned here, in stream order: earlier tasks may still read the
    // workspace's previous contents.
    poison_if_enabled(out);
    switch (out.dtype()) {
      case mx::float16:
        dequantize_rows(packed, scales, biases, out.data<mx::float16_t>(), gs, bits);
        break;
      case mx::bfloat16:
        dequantize_rows(packed, scales, biases, out.data<mx::bfloat16_t>(), gs, bits);
        break;
      default:
        dequantize_rows(packed, scales, biases, out.data<float>(), gs, bits);
        break;
    }
  });
}

} // namespace mlxq
