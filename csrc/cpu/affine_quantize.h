// MLX's CPU affine quantization of one group, reproduced so that a cache row
// written by QuantizedRingUpdate is bit-identical to `mx.quantize` of the same
// row on the CPU:
//   n_bins = 2^bits - 1; scale = max((max - min) / n_bins, 1e-7), signed and
//   snapped so that the group edge of larger magnitude is exactly
//   representable (edge = q0 * scale, bias = edge) unless it rounds to code 0;
//   codes = clamp(rint((w - bias) / scale), 0, n_bins), with the unrounded
//   float scale and bias; scale and bias are stored in the input's dtype.
// This file is compiled without reassociation or FMA contraction: the
// divisions and subtractions must round exactly as MLX's do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mlxq::cpu {

struct GroupQuant {
  float scale;
  float bias;
};

inline GroupQuant affine_group_params(const float* w, int group_size, int bits) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (int j = 0; j < group_size; ++j) {
    w_max = std::max(w_max, w[j]);
    w_min = std::min(w_min, w[j]);
  }
  const bool min_side = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, 1e-7f);
  scale = min_side ? scale : -scale;
  const float edge = min_side ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0.0f;
  if (q0 != 0.0f) {
    scale = edge / q0;
    bias = edge;
  }
  return {scale, bias};
}

inline uint32_t affine_code(float w, GroupQuant g, int bits) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  float c = std::rint((w - g.bias) / g.scale);
  c = std::min(std::max(c, 0.0f), n_bins);
  return static_cast<uint32_t>(c);
}

// ORs `code` into a row's little-endian bit stream at element i.
inline void put_code(uint32_t* words, int i, int bits, uint32_t code) {
  const int bit = i * bits;
  const int word = bit >> 5;
  const int off = bit & 31;
  words[word] |= code << off;
  if (off + bits > 32) {
    words[word + 1] |= code >> (32 - off);
  }
}

} // namespace mlxq::cpu
