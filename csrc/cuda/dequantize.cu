// CUDA DequantizeInto: one thread per 8 consecutive codes of a row (BITS
// bytes of its bit stream, which may straddle two words), written as one
// vector store; scale * code + bias in f32, rounded once to the output type.
#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&v)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 u;
    u.x = pack2<T>(v[0], v[1]);
    u.y = pack2<T>(v[2], v[3]);
    u.z = pack2<T>(v[4], v[5]);
    u.w = pack2<T>(v[6], v[7]);
    *reinterpret_cast<uint4*>(dst) = u;
  }
}

template <int BITS, typename T>
__global__ void dequantize_kernel_impl(DequantArgs a) {
  const int per_row = a.D / 8;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < a.chunks;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = c / per_row;
    const int j = static_cast<int>(c % per_row);
    const int n = static_cast<int>(row % a.N);
    const int64_t bh = row / a.N;
    const int h = static_cast<int>(bh % a.H), b = static_cast<int>(bh / a.H);
    const uint32_t* w = a.w + b * a.w_st[0] + h * a.w_st[1] + n * a.w_st[2];
    const int byte = j * BITS, wi = byte >> 2, sh = (byte & 3) * 8;
    uint64_t bits = w[wi * a.w_st[3]];
    if (sh + 8 * BITS > 32) {
      bits |= uint64_t(w[(wi + 1) * a.w_st[3]]) << 32;
    }
    bits >>= sh;
    const int g = j * 8 / a.gs;
    const float s =
        load_float(a.s, b * a.s_st[0] + h * a.s_st[1] + n * a.s_st[2] + g * a.s_st[3], a.s_dtype);
    const float z =
        load_float(a.z, b * a.z_st[0] + h * a.z_st[1] + n * a.z_st[2] + g * a.z_st[3], a.s_dtype);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = fmaf(s, float(uint32_t(bits >> (k * BITS)) & ((1u << BITS) - 1u)), z);
    }
    store8(static_cast<T*>(a.out) + row * a.D + j * 8, v);
  }
}

template <typename T>
void* for_bits(int bits) {
  switch (bits) {
    case 2:
      return handle<dequantize_kernel_impl<2, T>>();
    case 3:
      return handle<dequantize_kernel_impl<3, T>>();
    case 4:
      return handle<dequantize_kernel_impl<4, T>>();
    case 5:
      return handle<dequantize_kernel_impl<5, T>>();
    case 6:
      return handle<dequantize_kernel_impl<6, T>>();
    default:
      return handle<dequantize_kernel_impl<8, T>>();
  }
}

} // namespace

void* dequantize_kernel(int bits, int out_dtype) {
  switch (out_dtype) {
    case kF16:
      return for_bits<__half>(bits);
    case kBF16:
      return for_bits<__nv_bfloat16>(bits);
    default:
      return for_bits<float>(bits);
  }
}

} // namespace mlxq::cuda
