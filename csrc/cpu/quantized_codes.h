// Unpacking MLX affine-quantized rows into float scratch, for the CPU kernels.
//
// Widths that divide 32 (2, 4, 8 bits) are unpacked in "slot order": the k-th
// code of every word goes to slots [k*W, (k+1)*W) where W is the row's word
// count. Each slot loop is then a plain shift-and-mask over consecutive words,
// which vectorises to one SIMD lane per word. The queries and the output
// accumulators live in the same slot order, so dot products and axpys never
// reorder anything; only the final output is put back in natural order.
// Widths 3, 5 and 6 straddle words and keep natural order.
#pragma once

#include <cstdint>

namespace mlxq::cpu {

template <int BITS>
struct Codes {
  static constexpr bool kWordAligned = 32 % BITS == 0;
  static constexpr int kPerWord = kWordAligned ? 32 / BITS : 1;
  static constexpr uint32_t kMask = (1u << BITS) - 1u;

  // Scratch slot of natural element i in a row of `dim` elements.
  static int slot(int i, int dim) {
    if constexpr (kWordAligned) {
      return (i % kPerWord) * (dim / kPerWord) + i / kPerWord;
    } else {
      (void)dim;
      return i;
    }
  }

  // dst[slot(i)] = code_i * scale[group(i)] for one row of `dim` codes.
  // `word_scale` is scratch of dim / kPerWord floats.
  static void unpack_scaled(
      const uint32_t* __restrict words,
      const float* __restrict group_scale,
      int dim,
      int group_size,
      float* __restrict dst,
      float* __restrict word_scale) {
    if constexpr (kWordAligned) {
      const int W = dim / kPerWord;
      const int words_per_group = group_size / kPerWord;
      for (int g = 0, j = 0; j < W; ++g) {
        for (int t = 0; t < words_per_group; ++t, ++j) {
          word_scale[j] = group_scale[g];
        }
      }
      for (int k = 0; k < kPerWord; ++k) {
        float* __restrict d = dst + k * W;
        const int shift = k * BITS;
        for (int j = 0; j < W; ++j) {
          d[j] = static_cast<float>((words[j] >> shift) & kMask) * word_scale[j];
        }
      }
    } else {
      (void)word_scale;
      const int groups = dim / group_size;
      for (int g = 0; g < groups; ++g) {
        const float s = group_scale[g];
        for (int i = g * group_size; i < (g + 1) * group_size; ++i) {
          const int bit = i * BITS;
          const int word = bit >> 5;
          const int off = bit & 31;
          uint64_t window = words[word];
          if (off + BITS > 32) {
            window |= static_cast<uint64_t>(words[word + 1]) << 32;
          }
          dst[i] = static_cast<float>((window >> off) & kMask) * s;
        }
      }
    }
  }
};

} // namespace mlxq::cpu
