// Facts about MLX's affine quantization layout shared by every mlxq primitive.
//
// `mx.quantize(x, group_size, bits)` of x [..., D] returns
//   packed [..., D * bits / 32] uint32 : codes as one little-endian bit stream,
//                                        value i at bits [i*bits, (i+1)*bits)
//   scales [..., D / group_size]        : x's dtype
//   biases [..., D / group_size]        : x's dtype
// and dequantizes as scale * code + bias per group.
#pragma once

#include <string>

namespace mlxq {

inline bool is_supported_bits(int bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 ||
      bits == 8;
}

inline bool is_supported_group_size(int group_size) {
  return group_size == 32 || group_size == 64 || group_size == 128;
}

inline const char* supported_bits_text() {
  return "2, 3, 4, 5, 6 or 8";
}

inline const char* supported_group_sizes_text() {
  return "32, 64 or 128";
}

// The largest head dimension the kernels accept (the size of their per-row
// scratch); 512 covers every released model.
constexpr int kMaxHeadDim = 512;

} // namespace mlxq
