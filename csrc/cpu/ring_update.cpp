// CPU RingUpdate and QuantizedRingUpdate.
//
// The output takes over the buffer's memory when MLX says the buffer may be
// donated (no other array holds it) and it is row-contiguous; only the T new
// rows are then written. Otherwise the output is a fresh row-contiguous copy
// of the buffer, and the caller's array is left unchanged.
#include <cstring>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

#include "cpu/affine_quantize.h"
#include "debug.h"
#include "ring_update.h"

namespace mlxq {

namespace {

// Points `out` at `in`'s memory when it can be updated in place; else gives
// it new memory and returns true: the caller must copy `in` into it.
bool take_or_allocate(const mx::array& in, mx::array& out, bool owned = false) {
  if (detail::can_update_in_place(in, owned)) {
    out.copy_shared_buffer(in);
    return false;
  }
  detail::note_ring_copy();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  poison_if_enabled(out);
  return true;
}

// Pointer to element (i0, i1, i2, 0) of a 4-D array, in bytes.
const char* row_ptr(const mx::array& a, int64_t i0, int64_t i1, int64_t i2) {
  const auto& st = a.strides();
  return a.data<char>() + (i0 * st[0] + i1 * st[1] + i2 * st[2]) * a.itemsize();
}

// Copies one row of n elements of `a` (any last-axis stride) to dst.
void copy_row(const mx::array& a, const char* src, char* dst, int n) {
  const size_t item = a.itemsize();
  const int64_t step = a.strides()[3];
  if (step == 1) {
    std::memcpy(dst, src, n * item);
    return;
  }
  for (int i = 0; i < n; ++i) {
    std::memcpy(dst + i * item, src + i * step * item, item);
  }
}

// Row-contiguous copy of a whole 4-D array into dst.
void copy_all(const mx::array& a, char* dst) {
  const int D = a.shape(3);
  const size_t row_bytes = size_t(D) * a.itemsize();
  for (int b = 0; b < a.shape(0); ++b) {
    for (int h = 0; h < a.shape(1); ++h) {
      for (int s = 0; s < a.shape(2); ++s) {
        copy_row(a, row_ptr(a, b, h, s), dst, D);
        dst += row_bytes;
      }
    }
  }
}

// First ring row written: pos mod S (a negative array position wraps too).
int ring_start(const mx::array& pos, int S) {
  const int64_t p = pos.data<int32_t>()[0];
  return static_cast<int>(((p % S) + S) % S);
}

// The arrays one quantized write fills; a null part is not written.
template <typename Scalar>
struct QuantizedRows {
  uint32_t* codes;
  Scalar* scales;
  Scalar* biases;
  int S; // ring rows
};

// Quantizes the T update rows and writes the requested parts of them into
// ring rows (start + t) mod S.
template <typename Scalar>
void quantize_rows(
    const mx::array& update,
    const QuantizedRows<Scalar>& dst,
    int start,
    int group_size,
    int bits) {
  const int B = update.shape(0), H = update.shape(1), T = update.shape(2);
  const int D = update.shape(3), S = dst.S;
  const int W = D * bits / 32, G = D / group_size;
  std::vector<float> row(D);
  std::vector<Scalar> raw(D);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < T; ++t) {
        copy_row(update, row_ptr(update, b, h, t), reinterpret_cast<char*>(raw.data()), D);
        for (int i = 0; i < D; ++i) {
          row[i] = static_cast<float>(raw[i]);
        }
        const int64_t r = (int64_t(b) * H + h) * S + (start + t) % S;
        uint32_t* words = dst.codes ? dst.codes + r * W : nullptr;
        if (words) {
          std::memset(words, 0, sizeof(uint32_t) * W);
        }
        for (int g = 0; g < G; ++g) {
          const float* w = row.data() + g * group_size;
          const auto q = cpu::affine_group_params(w, group_size, bits);
          if (dst.scales) {
            dst.scales[r * G + g] = static_cast<Scalar>(q.scale);
          }
          if (dst.biases) {
            dst.biases[r * G + g] = static_cast<Scalar>(q.bias);
          }
          if (words) {
            for (int j = 0; j < group_size; ++j) {
              cpu::put_code(words, g * group_size + j, bits, cpu::affine_code(w[j], q, bits));
            }
          }
        }
      }
    }
  }
}

// quantize_rows for the update's dtype; `codes`/`scales`/`biases` may be null.
void quantize_rows_any(
    const mx::array& update,
    mx::array* codes,
    mx::array* scales,
    mx::array* biases,
    int S,
    int start,
    int group_size,
    int bits) {
  auto run = [&](auto tag) {
    using Scalar = decltype(tag);
    QuantizedRows<Scalar> dst{
        codes ? codes->data<uint32_t>() : nullptr,
        scales ? scales->data<Scalar>() : nullptr,
        biases ? biases->data<Scalar>() : nullptr,
        S};
    quantize_rows<Scalar>(update, dst, start, group_size, bits);
  };
  switch (update.dtype()) {
    case mx::float16:
      run(mx::float16_t{});
      break;
    case mx::bfloat16:
      run(mx::bfloat16_t{});
      break;
    default:
      run(float{});
      break;
  }
}

// Writes `update`'s T rows into `out`'s ring rows (start + t) mod S.
void write_rows(const mx::array& update, mx::array& out, int start) {
  char* dst = out.data<char>();
  const int B = out.shape(0), H = out.shape(1), S = out.shape(2), D = out.shape(3);
  const int T = update.shape(2);
  const size_t row_bytes = size_t(D) * out.itemsize();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < T; ++t) {
        const int64_t r = (int64_t(b) * H + h) * S + (start + t) % S;
        copy_row(update, row_ptr(update, b, h, t), dst + r * row_bytes, D);
      }
    }
  }
}

} // namespace

void RingUpdate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  const auto& pos = inputs[2];
  const bool copy = take_or_allocate(buffer, out, owned_);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([buffer, update, pos, out = mx::array::unsafe_weak_copy(out), copy]() mutable {
    if (copy) {
      copy_all(buffer, out.data<char>());
    }
    write_rows(update, out, ring_start(pos, out.shape(2)));
  });
}

void QuantizedRingUpdate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  const auto& pos = inputs[2];
  const bool copy = take_or_allocate(buffer, out, owned_);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([buffer,
                update,
                pos,
                out = mx::array::unsafe_weak_copy(out),
                copy,
                part = part_,
                gs = group_size_,
                bits = bits_]() mutable {
    if (copy) {
      copy_all(buffer, out.data<char>());
    }
    using Part = QuantizedRingUpdate::Part;
    quantize_rows_any(
        update,
        part == Part::Codes ? &out : nullptr,
        part == Part::Scales ? &out : nullptr,
        part == Part::Biases ? &out : nullptr,
        out.shape(2),
        ring_start(pos, out.shape(2)),
        gs,
        bits);
  });
}

void QuantizedKVUpdate::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // inputs: K packed, scales, biases, V packed, scales, biases, K update,
  // V update, pos, then (recent) the rings and their rows; outputs: the six
  // buffers (then their fetch views, then the rings). `buffers` pairs each
  // written buffer's input with its output: the six, then the rings.
  std::vector<std::pair<int, int>> buffers;
  for (int i = 0; i < 6; ++i) {
    buffers.emplace_back(i, i);
  }
  if (recent_) {
    buffers.emplace_back(9, recent_output());
    buffers.emplace_back(10, recent_output() + 1);
  }
  std::vector<bool> copy;
  for (auto [in, out] : buffers) {
    const bool owned = in < 6 || recent_owned_;
    copy.push_back(take_or_allocate(inputs[in], outputs[out], owned));
  }
  detail::set_prefix_views(outputs, fetch_ >= 0);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  std::vector<mx::array> outs;
  for (auto [in, out] : buffers) {
    enc.set_output_array(outputs[out]);
    outs.push_back(mx::array::unsafe_weak_copy(outputs[out]));
  }
  enc.dispatch([inputs,
                outs = std::move(outs),
                buffers = std::move(buffers),
                copy = std::move(copy),
                gs = group_size_,
                bits = bits_,
                ring_pos = recent_pos_input()]() mutable {
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (copy[i]) {
        copy_all(inputs[buffers[i].first], outs[i].data<char>());
      }
    }
    const int S = outs[0].shape(2);
    const int start = ring_start(inputs[8], S);
    for (int kv = 0; kv < 2; ++kv) {
      quantize_rows_any(
          inputs[6 + kv],
          &outs[3 * kv],
          &outs[3 * kv + 1],
          &outs[3 * kv + 2],
          S,
          start,
          gs[kv],
          bits[kv]);
    }
    for (int kv = 0; kv < 2 && outs.size() > 6; ++kv) { // the recent rings
      mx::array& ring = outs[6 + kv];
      write_rows(inputs[11 + kv], ring, ring_start(inputs[ring_pos], ring.shape(2)));
    }
  });
}

} // namespace mlxq
