// Facts about MLX's affine quantization layout shared by every mlxq primitive.
//
// `mx.quantize(x, group_size, bits)` of x [..., D] returns
//   packed [..., D * bits / 32] uint32 : codes as one little-endian bit stream,
//                                        value i at bits [i*bits, (i+1)*bits)
//   scales [..., D / group_size]        : x's dtype
//   biases [..., D / group_size]        : x's dtype
// and dequantizes as scale * code + bias per group.
#pragma once

#include <algorithm>
#include <array>
#include <string>

namespace mlxq {

// The options every mlxq kernel supports (Python reads them from the
// extension: mlxq.quantization).
constexpr std::array<int, 6> kSupportedBits{2, 3, 4, 5, 6, 8};
constexpr std::array<int, 3> kSupportedGroupSizes{32, 64, 128};

inline bool is_supported_bits(int bits) {
  return std::find(kSupportedBits.begin(), kSupportedBits.end(), bits) != kSupportedBits.end();
}

inline bool is_supported_group_size(int group_size) {
  return std::find(kSupportedGroupSizes.begin(), kSupportedGroupSizes.end(), group_size) !=
      kSupportedGroupSizes.end();
}

// "2, 3, 4, 5, 6 or 8": a list of options for error messages.
template <size_t N>
std::string options_text(const std::array<int, N>& options) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    text += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::to_string(options[i]);
  }
  return text;
}

inline std::string supported_bits_text() {
  return options_text(kSupportedBits);
}

inline std::string supported_group_sizes_text() {
  return options_text(kSupportedGroupSizes);
}

// The largest head dimension the kernels accept (the size of their per-row
// scratch); 512 covers every released model.
constexpr int kMaxHeadDim = 512;

} // namespace mlxq
