// Integer dot products for the CPU attention kernel (bf16/f16 queries).
//
// Unpacking codes to floats and multiplying in f32 made the decode kernel
// compute-bound at 3-4 GB/s. Here the codes stay integers: 16-bit lanes
// multiplied in pairs into 32-bit sums (AVX-512 VNNI `vpdpwssd`, or
// `vpmaddwd` + add on AVX-512BW), 32 products per instruction against f32's
// 16, and no int-to-float conversion per code.
//
//   scores  the query, scaled, is quantized per K group to int16 once per
//           tile (its float group sums stay exact for the bias term), and
//           s_j = sum_g k_scale_jg * q_scale_g * sum_{i in g} code_ji q_i.
//           Lanes are keys: 16 keys' packed words are gathered per vector,
//           so no horizontal sums.
//   values  each chunk's softmax weights times V's group scales are
//           quantized per (row, group) to int16, and
//           o_i += w_scale_g * sum_j w_j code_ji, lanes are elements,
//           two keys per 32-bit lane.
//
// Why 16 bits and not int8 queries: int8 per-group queries measured 3e-3 to
// 1.7e-2 relative error against float64 (|q| 1 to 8, N 64 to 32k), over
// f16's 2e-3 tolerance and at bf16's 1e-2; int16 measured 1e-5 to 6e-5.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sdpa_codes.h"

namespace mlxq::cpu {

// One chunk of at most 32 keys of one (batch, KV head), and its format.
struct IntKeys {
  const uint32_t* words; // the chunk's first key's packed row
  int64_t row_words; // words from one key's row to the next
  const void* scale; // the first key's group scales (then its biases)
  const void* bias;
  int64_t param_row; // scales (and biases) from one key to the next
  DtypeCode param_dtype;
  int n; // keys in the chunk
  int bits, D, group_size;
};

// Rows ahead of the one being read that the kernels prefetch into L2 (two
// chunks). The hardware prefetchers stop at each 4 KB page, so where a row
// is 256 bytes (8-bit D = 256) every 16 keys began with a full memory
// latency: the kernel read 7-10 GB/s of a machine's 24. Prefetched, it reads
// 15-20. Prefetches past the end of the keys are harmless (they never fault).
constexpr int kPrefetchKeys = 64;

// Prefetches (into L2) the group parameters at `src` (a chunk's scales or
// biases, G per key) of the chunk kPrefetchKeys keys on.
inline void prefetch_params(const IntKeys& k, const void* src, int G) {
  const std::size_t item = k.param_dtype == kF32 ? 4 : 2, row = k.param_row * item;
  const char* ahead = static_cast<const char*>(src) + kPrefetchKeys * row;
  if (k.param_row == G) { // contiguous
    for (std::size_t b = 0; b < 32 * G * item; b += 64) {
      __builtin_prefetch(ahead + b, 0, 2);
    }
  } else {
    for (int j = 0; j < 32; ++j) {
      __builtin_prefetch(ahead + j * row, 0, 2);
    }
  }
}

// Scratch for a chunk's rows spread to one byte per code (32 rows of D).
inline uint8_t* byte_rows(int D) {
  thread_local std::vector<uint8_t> buf;
  buf.resize(std::max<std::size_t>(buf.size(), std::size_t(32) * D));
  return buf.data();
}

// k's rows as spread to `bytes` (D per row): 8-bit keys of the same groups.
inline IntKeys byte_keys(const IntKeys& k, const uint8_t* bytes) {
  IntKeys wide = k;
  wide.words = reinterpret_cast<const uint32_t*>(bytes);
  wide.row_words = k.D / 4;
  wide.bits = 8;
  return wide;
}

// A tile's rows: the softmax state the kernels read and add to.
struct IntRows {
  int R;
  const int32_t* qpairs; // [R][D / 2]: the query's int16 pairs (key_pair order)
  const float* qscale; // [R][G]: their per-group steps
  const float* qsum; // [R][G]: the scaled query's float group sums
};

// Most partial sums per (row, group) any kernel keeps for the V bias terms.
constexpr int kMaxBiasLanes = 16;

struct IntDot {
  const char* name;
  // The element `values` keeps in output lane `lane` (a permutation of
  // 0 .. D - 1 for codes of `bits` bits, the kernels' unpacking order).
  int (*element)(int bits, int lane);
  // s[rr * 32 + j] = sum_g k_scale_jg * qscale_g * (codes_j . q)_g
  //                + sum_g k_bias_jg * qsum_g, for j < n (later lanes: any).
  void (*scores)(const IntKeys& k, const IntRows& rows, float* s);
  // With p[rr * 32 + j] the chunk's weights (0 past n) and peak[rr] their
  // largest (from this kernel's softmax; kernels without one ignore it):
  // o[rr * D + lane] += sum_j p_j v_scale_jg code_j,element(lane), and
  // sum_t obias[(rr * G + g) * bias_lanes + t] += sum_j p_j v_bias_jg.
  void (
      *values)(const IntKeys& v, int R, const float* p, const float* peak, float* o, float* obias);
  // The online softmax of a chunk (32 scores per row, -inf where hidden):
  // s becomes exp(s - m_new), peak[rr] its largest, l and m are updated and
  // o ([R][Dv]) and obias ([R][Gv][bias_lanes]) rescaled to the new max.
  // Null: the tile kernel's own (then bias_lanes is 1).
  void (*softmax)(
      int R,
      float* s,
      float* m,
      float* l,
      float* peak,
      float* o,
      int Dv,
      float* obias,
      int Gv);
  int bias_lanes;
};

// The best integer kernels this CPU runs (AVX-512 VNNI, AVX-512BW, AVX2),
// or null (none of them, or MLXQ_CPU_INT=0): the kernel then multiplies in
// f32. MLXQ_CPU_INT=avx2 (or avx512-bw) asks for those kernels where the CPU
// has more.
const IntDot* int_dot();

// Whether the integer path covers codes of `bits` bits, head dim D and
// group size gs. Codes of 2, 3, 5 and 6 bits are first spread to one byte
// per code (spread_bytes: AVX-512 VBMI byte permutes, or AVX2 shuffles and
// shifts), then taken by the 8-bit kernels (so `element` and key_pair treat
// them as 8-bit).
inline bool int_dot_covers(int bits, int D, int gs) {
  const bool width = bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
  const int block = bits == 4 ? 128 : 64; // elements per 64 bytes the kernels read
  return width && D % block == 0 && gs >= 32 && gs <= 128 && D % gs == 0 && D / gs <= 16 &&
      D <= 512;
}

// The two elements key pair m multiplies (lanes of the 32-bit words the key
// kernel gathers: 4-bit words hold elements 8w..8w+7, pairs (t, t+4);
// 8-bit words 4w..4w+3, pairs (t, t+2)).
inline void key_pair(int bits, int m, int& i0, int& i1) {
  if (bits == 4) {
    const int w = m / 4, t = m % 4;
    i0 = 8 * w + t;
    i1 = i0 + 4;
  } else {
    const int w = m / 2, t = m % 2;
    i0 = 4 * w + t;
    i1 = i0 + 2;
  }
}

} // namespace mlxq::cpu
