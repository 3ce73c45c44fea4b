// DequantizeInto (the dense K/V of a routed prefill layer, written into a
// reused workspace) and the fill that poisons its output in stream order.
//
// Layout
//   packed  [B, H, N, W] uint32, W = D * bits / 32: each row's codes as one
//           little-endian bit stream, code i at bits [i*bits, (i+1)*bits)
//   scales, biases [B, H, N, G] in p.scale_dtype (MQ_DT_*), G = D / group_size
//   out     row-contiguous [B, H, N, D] in T (the workspace's dtype)
//   All three inputs are read through their four strides (elements), so
//   sliced cache views are read in place.
//
// mlxq_dequantize_into: one thread per 8 consecutive codes of a row, grid
// (D / 8, N, B * H) threads. Codes 8j..8j+7 are the `bits` bytes starting at
// byte j * bits of the row's stream: at most two packed words (8 bits: two
// whole words; 3/5/6 bits may straddle a word boundary), shifted into one
// 64-bit window. The 8 codes share one quantization group (every group size
// is a multiple of 8). value = fma(scale, code, bias) in float, rounded once
// to T.
//
// mlxq_fill_u32: word y * p.cols + x of the destination set to p.pattern,
// grid (cols, ceil(n_words / cols)) threads.
#include "mlxq_utils.h"

template <typename T, int BITS>
[[kernel]] void mlxq_dequantize_into(
    const device uint* packed [[buffer(0)]],
    const device uchar* scales [[buffer(1)]],
    const device uchar* biases [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant MlxqDequantParams& p [[buffer(4)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int j = gid.x; // 8-code chunk of the row
  const int n = gid.y;
  const int bh = gid.z;
  if (j * 8 >= p.D || n >= p.N || bh >= p.B * p.H) {
    return;
  }
  const int b = bh / p.H;
  const int h = bh - b * p.H;

  const device uint* row = packed + b * p.w_strides[0] + h * p.w_strides[1] +
      n * p.w_strides[2];
  const int byte = j * BITS;
  const int wi = byte >> 2;      // first word holding the chunk
  const int sh = (byte & 3) * 8; // its first bit inside that word
  ulong window = row[wi * p.w_strides[3]];
  if (sh + 8 * BITS > 32) {
    window |= ulong(row[(wi + 1) * p.w_strides[3]]) << 32;
  }
  window >>= sh;

  const int g = j * 8 / p.group_size;
  const float scale = mlxq_load(
      scales,
      b * p.s_strides[0] + h * p.s_strides[1] + n * p.s_strides[2] +
          g * p.s_strides[3],
      p.scale_dtype);
  const float bias = mlxq_load(
      biases,
      b * p.b_strides[0] + h * p.b_strides[1] + n * p.b_strides[2] +
          g * p.b_strides[3],
      p.scale_dtype);

  device T* dst = out + (mlxq_i64(bh) * p.N + n) * p.D + j * 8;
  const uint mask = (1u << BITS) - 1u;
  for (int k = 0; k < 8; ++k) {
    const float code = float(uint(window >> (k * BITS)) & mask);
    dst[k] = mlxq_from_float<T>(fma(scale, code, bias));
  }
}

[[kernel]] void mlxq_fill_u32(
    device uint* dst [[buffer(0)]],
    constant MlxqFillParams& p [[buffer(1)]],
    uint3 gid [[thread_position_in_grid]]) {
  const mlxq_i64 i = mlxq_i64(gid.y) * p.cols + gid.x;
  if (int(gid.x) < p.cols && i < p.n_words) {
    dst[i] = p.pattern;
  }
}

#define MQ_INST_DEQUANT(tname, T, bits)         \
  MQ_INSTANTIATE(                               \
      "mlxq_dequantize_into_" #tname "_b" #bits,  \
      mlxq_dequantize_into, T, bits)
#define MQ_INST_DEQUANT_TYPE(tname, T) \
  MQ_INST_DEQUANT(tname, T, 2)         \
  MQ_INST_DEQUANT(tname, T, 3)         \
  MQ_INST_DEQUANT(tname, T, 4)         \
  MQ_INST_DEQUANT(tname, T, 5)         \
  MQ_INST_DEQUANT(tname, T, 6)         \
  MQ_INST_DEQUANT(tname, T, 8)

MQ_INST_DEQUANT_TYPE(f32, float)
MQ_INST_DEQUANT_TYPE(f16, half)
MQ_INST_DEQUANT_TYPE(bf16, mlxq_bfloat16)
