// CUDA QuantizedSDPA, tensor-core tiled path: prefill and other many-row
// calls (f16/bf16 queries, Dk = Dv in {64, 128, 256, 512}, every bit width,
// group size and mask kind, sinks).
//
// Why this shape: with many query rows per KV head the work is the two
// matmuls, not the bytes, so each K/V tile is unpacked once into shared
// memory for 64 (or 128) query rows and both products run on mma.sync.m16n8k16
// (flash-attention style, f32 accumulators, online softmax in registers):
//   * a block is 4 (or 8) warps x 16 query rows of one KV head (its query
//     heads x positions) and walks the keys of one split in tiles of 32;
//   * K is dequantized (scale * code + bias, in f32) to the query's dtype and
//     S = Q . K^T runs in that dtype;
//   * V stays as exact integer codes (bf16) and the scales go on the other
//     operand: O += (P * scale_v) . codes per group, plus sum(P * bias_v).
//     So a key whose weight is 0 adds exactly 0 even if its scales are not
//     finite, and bf16 keeps f32's exponent range for P * scale. For f16
//     queries P * scale is split in a high and a low bf16 term (two mmas),
//     which keeps the value product near f16 precision;
//   * the next tile's packed words are copied to shared memory (cp.async)
//     and its scales loaded into registers while this tile computes;
//   * a causal row tile stops at its last row's limit (hidden tiles are
//     never read); masks are applied per score only on tiles that need it.
//   * at head dims 256 and 512 (Gemma's layers) a warp's accumulators for
//     every output column would not fit its registers: PARTS = D / 128 warps
//     then share each 16-row slice, each owning 128 output columns (DV) and
//     a D / PARTS slice of the score products, which they sum through shared
//     memory. So the scores are computed once, not once per column slice,
//     and a block still stages each K/V tile for 64 rows.
//   * dense (DENSE, head dims 256 and 512 with many rows): the host first
//     dequantizes the layer's K and V once into a dense copy in the query's
//     dtype, and the blocks copy its tiles with cp.async (double-buffered)
//     instead of each block unpacking every tile again: at head dim 512 a
//     tile's unpacking took ~3.5x the issue time of its mma.sync. P . V then
//     runs on the dense values (no per-group scales). Unlike the codes path,
//     a masked key whose dequantized V is not finite (non-finite scales)
//     poisons the rows of its tile: 0 * NaN in the products.
// Grid: (row tiles x Hkv, splits, B), heavier (later) causal row
// tiles first; the row tiles go in x, whose limit is 2^31 - 1 (y and z stop
// at 65535).
// One split writes the output; several (few rows, long N) write partials for
// merge_kernel.
#pragma once

#include <cfloat>
#include <climits>
#include <type_traits>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

// Code j of 8 consecutive codes (bits [8 * BITS) of w1:w0 from `shift`) as
// an exact float: OR-ing it into the mantissa of 2^23 and subtracting.
template <int BITS>
__device__ __forceinline__ void unpack8(uint32_t w0, uint32_t w1, int shift, float (&c)[8]) {
  const uint64_t v = ((uint64_t(w1) << 32) | w0) >> shift;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t code = uint32_t(v >> (j * BITS)) & ((1u << BITS) - 1u);
    c[j] = __uint_as_float(0x4B000000u | code) - 8388608.0f;
  }
}

// This thread's scales and biases of one tile, fetched a tile ahead.
template <int D, int GS, int THREADS, int KEYS>
struct Scales {
  static constexpr int kChunks = KEYS * (D / 8) / THREADS; // 8-code chunks of K (and V)
  static constexpr int kV = (KEYS * (D / GS) + THREADS - 1) / THREADS; // V (key, group)s
  float ks[kChunks], kb[kChunks];
  float vs[kV], vb[kV];
};

// The tiled kernel's constants and its stages: run() is the kernel's body, a
// prologue and a loop over the other stages, each called once per tile (or
// per block) and always inlined. The per-thread values reach compute_tile,
// load_queries and write_output by const reference, as they did when the
// stages were lambdas of the kernel: passed by value, nvcc allocates
// registers differently (8 instructions fewer of ~6,300 at head dim 128, not
// byte-identical), and identical SASS is what shows this split changed
// nothing.
template <typename T, int D, int GS, int WARPS, int KEYS, int PARTS, bool DENSE>
struct TiledStages {
  static constexpr int DV = D / PARTS; // output columns of a block
  static constexpr int kGV = DV / GS; // their groups
  static_assert(DV % GS == 0, "a block's output columns are whole groups");
  static constexpr int kThreads = 32 * WARPS * PARTS;
  static constexpr int kRows = 16 * WARPS; // WARPS row slices of 16
  static constexpr int kKP = D / 16 / PARTS; // 16-dim score steps of a part
  static constexpr int kKeys = KEYS;
  static constexpr int kSN = KEYS / 8; // n-tiles of scores
  static constexpr int kKS = KEYS / 16; // 16-key steps of values
  static constexpr int kStride = D + 8; // smem row (elements): conflict-free ldmatrix
  static constexpr int kCPR = D / 8; // chunks per row
  static constexpr int kG = D / GS;
  static constexpr int kNT = DV / 8; // n-tiles of a block's output
  static constexpr bool kTwoTerms = std::is_same_v<T, __half>;
  using ScalesT = Scales<D, GS, kThreads, KEYS>;
  static_assert(kKeys * kCPR % kThreads == 0, "tile layout");

  // Ring issue: tile c0's packed K and V words (keys below n1, W words per
  // row) into kraw / vraw, asynchronously.
  __device__ __forceinline__ static void fetch_words(
      const SdpaArgs& a,
      const uint32_t* kw0,
      const uint32_t* vw0,
      uint32_t* kraw,
      uint32_t* vraw,
      int W,
      int n1,
      int c0) {
    const int total = kKeys * W;
    if (a.vec_loads) { // 16-byte aligned rows (host-checked)
      for (int i = 4 * threadIdx.x; i < total; i += 4 * kThreads) {
        const int key = i / W, col = i % W, n = c0 + key;
        if (n < n1) {
          cp_async<16>(kraw + i, kw0 + int64_t(n) * a.kw_st[2] + col);
          cp_async<16>(vraw + i, vw0 + int64_t(n) * a.vw_st[2] + col);
        }
      }
    } else {
      for (int i = threadIdx.x; i < total; i += kThreads) {
        const int key = i / W, col = i % W, n = c0 + key;
        if (n < n1) {
          cp_async<4>(kraw + i, kw0 + int64_t(n) * a.kw_st[2] + col);
          cp_async<4>(vraw + i, vw0 + int64_t(n) * a.vw_st[2] + col);
        }
      }
    }
  }

  // Dense ring issue: tile c0's rows of the dense K and V copies (keys below
  // n1; zeros past it, so no stale value meets a zero weight) into kbuf /
  // vbuf, asynchronously.
  __device__ __forceinline__ static void fetch_dense(
      const uint16_t* kd0,
      const uint16_t* vd0,
      uint16_t* kbuf,
      uint16_t* vbuf,
      int n1,
      int c0) {
    for (int i = threadIdx.x; i < kKeys * kCPR; i += kThreads) {
      const int key = i / kCPR, c = i % kCPR, n = c0 + key;
      const int bytes = n < n1 ? 16 : 0;
      const int64_t src = int64_t(n < n1 ? n : c0) * D + c * 8;
      cp_async_zfill<16>(smem_addr(kbuf + key * kStride + c * 8), kd0 + src, bytes);
      cp_async_zfill<16>(smem_addr(vbuf + key * kStride + c * 8), vd0 + src, bytes);
    }
  }

  // This thread's scales and biases of tile c0 (zeros past n1), a tile ahead.
  __device__ __forceinline__ static void fetch_scales(
      const SdpaArgs& a,
      int64_t ks0,
      int64_t kb0,
      int64_t vs0,
      int64_t vb0,
      int n1,
      ScalesT& sc,
      int c0) {
#pragma unroll
    for (int u = 0; u < ScalesT::kChunks; ++u) {
      const int i = threadIdx.x + u * kThreads;
      const int n = c0 + i / kCPR, g = (i % kCPR) * 8 / GS;
      const bool ok = n < n1;
      sc.ks[u] = ok ? load_float(a.ks, ks0 + n * a.ks_st[2] + g * a.ks_st[3], a.scale_dtype) : 0.0f;
      sc.kb[u] = ok ? load_float(a.kb, kb0 + n * a.kb_st[2] + g * a.kb_st[3], a.scale_dtype) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < ScalesT::kV; ++u) {
      const int i = threadIdx.x + u * kThreads;
      const int n = c0 + i / kG, g = i % kG;
      const bool ok = i < kKeys * kG && n < n1;
      sc.vs[u] = ok ? load_float(a.vs, vs0 + n * a.vs_st[2] + g * a.vs_st[3], a.scale_dtype) : 0.0f;
      sc.vb[u] = ok ? load_float(a.vb, vb0 + n * a.vb_st[2] + g * a.vb_st[3], a.scale_dtype) : 0.0f;
    }
  }

  // Unpacks a landed tile into shared memory: K dequantized to T, V codes as
  // exact bf16, V scales and biases as f32. Words past n1 are stale but finite
  // codes, and their scales are 0.
  __device__ __forceinline__ static void stage(
      const uint32_t* kraw,
      const uint32_t* vraw,
      uint16_t* ks,
      uint16_t* vs,
      float* vsc,
      float* vbi,
      int W,
      int bits,
      const ScalesT& sc) {
    auto body = [&](auto bits_tag) {
      constexpr int BITS = decltype(bits_tag)::value;
#pragma unroll
      for (int u = 0; u < ScalesT::kChunks; ++u) {
        const int i = threadIdx.x + u * kThreads;
        const int key = i / kCPR, c = i % kCPR;
        const int byte = c * BITS, wi = key * W + (byte >> 2), sh = (byte & 3) * 8;
        const bool two = sh + 8 * BITS > 32;
        float x[8];
        unpack8<BITS>(kraw[wi], two ? kraw[wi + 1] : 0u, sh, x);
        uint4 kv, vv;
        uint32_t* kp = &kv.x;
        uint32_t* vp = &vv.x;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          kp[j] =
              pack2<T>(fmaf(sc.ks[u], x[2 * j], sc.kb[u]), fmaf(sc.ks[u], x[2 * j + 1], sc.kb[u]));
        }
        unpack8<BITS>(vraw[wi], two ? vraw[wi + 1] : 0u, sh, x);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          vp[j] = pack2<__nv_bfloat16>(x[2 * j], x[2 * j + 1]);
        }
        *reinterpret_cast<uint4*>(ks + key * kStride + c * 8) = kv;
        *reinterpret_cast<uint4*>(vs + key * kStride + c * 8) = vv;
      }
    };
    switch (bits) {
      case 2:
        body(std::integral_constant<int, 2>{});
        break;
      case 3:
        body(std::integral_constant<int, 3>{});
        break;
      case 4:
        body(std::integral_constant<int, 4>{});
        break;
      case 5:
        body(std::integral_constant<int, 5>{});
        break;
      case 6:
        body(std::integral_constant<int, 6>{});
        break;
      default:
        body(std::integral_constant<int, 8>{});
        break;
    }
#pragma unroll
    for (int u = 0; u < ScalesT::kV; ++u) {
      const int i = threadIdx.x + u * kThreads;
      if (i < kKeys * kG) {
        vsc[i] = sc.vs[u];
        vbi[i] = sc.vb[u];
      }
    }
  }

  // Step: one tile of keys for this warp's 16 rows: scores S = Q . K^T on
  // tensor cores, masks, the online softmax update of (m, l), and the value
  // products O += (P * scale_v) . codes + sum(P * bias_v) per group.
  __device__ __forceinline__ static void compute_tile(
      const SdpaArgs& a,
      const uint16_t* const& qs,
      const uint16_t* const& ks,
      const uint16_t* const& vs,
      const float* const& vsc,
      const float* const& vbi,
      const int& lane,
      const int& t4,
      const int& wr0,
      const int& b,
      const int& n1,
      const int& warp_first_lim,
      const int& gv0,
      const int& dv0,
      const int& part,
      float* const& red,
      const float& scale2,
      const bool (&live)[2],
      const int (&lim)[2],
      const int (&head)[2],
      const int (&lpos)[2],
      float (&m)[2],
      float (&l)[2],
      float (&vbias)[2][kGV],
      float (&acc)[kNT][4],
      int c0) {
    // S = Q . K^T: 16 rows x KEYS keys (n-tiles of 8 keys).
    float s[kSN][4];
#pragma unroll
    for (int n = 0; n < kSN; ++n)
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    const uint16_t* qrow =
        qs + (wr0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + 8 * (lane >> 4);
    const uint16_t* krow = ks + ((lane & 7) + 8 * (lane >> 4)) * kStride + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < kKP; ++kk) {
      const int d0 = (part * kKP + kk) * 16;
      uint32_t qa[4];
      ldsm_x4(qa, qrow + d0);
#pragma unroll
      for (int np = 0; np < kKS; ++np) {
        uint32_t kb4[4];
        ldsm_x4(kb4, krow + np * 16 * kStride + d0);
        mma<T>(s[2 * np], qa, kb4[0], kb4[1]);
        mma<T>(s[2 * np + 1], qa, kb4[2], kb4[3]);
      }
    }
    if constexpr (PARTS > 1) {
      // The parts' sums over their dims, added in one order by every part
      // (so all of them get the same scores, maxima and sums).
      const int slice = wr0 / 16, lane_at = threadIdx.x & 31;
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          red[((part * WARPS + slice) * kSN * 4 + n * 4 + e) * 32 + lane_at] = s[n][e];
        }
      }
      named_barrier(1 + slice, 32 * PARTS);
#pragma unroll
      for (int n = 0; n < kSN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = 0.0f;
#pragma unroll
          for (int q = 0; q < PARTS; ++q) {
            x += red[((q * WARPS + slice) * kSN * 4 + n * 4 + e) * 32 + lane_at];
          }
          s[n][e] = x;
        }
      }
    }

    // Scale, mask, online softmax (rows ra: s[n][0..1], rb: s[n][2..3]).
    const bool plain = a.mask_kind != kMaskArray && c0 + kKeys <= n1 &&
        (a.mask_kind != kMaskCausal || c0 + kKeys - 1 <= warp_first_lim);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        float x = s[n][e] * scale2;
        if (!plain) {
          const int key = c0 + 8 * n + 2 * t4 + (e & 1);
          bool vis = live[h] && key < n1 && key <= lim[h];
          if (vis && a.mask_kind == kMaskArray) {
            const int64_t mo = b * a.m_st[0] + head[h] * a.m_st[1] + lpos[h] * a.m_st[2] +
                int64_t(key) * a.m_st[3];
            const float mv = load_float(a.mask, mo, a.mask_dtype);
            if (a.mask_dtype == kBool) {
              vis = mv != 0.0f;
            } else {
              // A finite bias stays finite in log2 units (finfo.min fills).
              x += mv == -INFINITY ? mv : fmaxf(mv * kLog2e, -FLT_MAX);
            }
          }
          x = vis ? x : -INFINITY;
        }
        s[n][e] = x;
        mx[h] = fmaxf(mx[h], x);
      }
    }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = lanes_max<1, 2>(mx[h]);
      const float m_new = fmaxf(m[h], mx[h]);
      corr[h] = m_new == -INFINITY ? 1.0f : exp2f(m[h] - m_new);
      m[h] = m_new;
    }
#pragma unroll
    for (int n = 0; n < kSN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        s[n][e] = m[h] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[h]);
      }
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        acc[i][0] *= corr[0];
        acc[i][1] *= corr[0];
        acc[i][2] *= corr[1];
        acc[i][3] *= corr[1];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kSN; ++n)
        sum += s[n][2 * h] + s[n][2 * h + 1];
      l[h] = l[h] * corr[h] + sum;
    }
    if constexpr (DENSE) {
      // O += P . V on the dense values, per 16-key step.
      const uint16_t* vrow =
          vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + 8 * (lane >> 4) + dv0;
#pragma unroll
      for (int j = 0; j < kKS; ++j) {
        uint32_t pa[4]; // a-register order: (ra, keys lo), (rb, lo), (ra, hi), (rb, hi)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int n = 2 * j + (q >> 1), h = q & 1;
          pa[q] = pack2<T>(s[n][2 * h], s[n][2 * h + 1]);
        }
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t vb4[4];
          ldsm_x4_trans(vb4, vrow + j * 16 * kStride + 16 * np);
          mma<T>(acc[2 * np], pa, vb4[0], vb4[1]);
          mma<T>(acc[2 * np + 1], pa, vb4[2], vb4[3]);
        }
      }
    } else {
      // Keys of this thread: 8 n + 2 t4 + (e & 1), scales at vsc[key * kG + g].
#pragma unroll
      for (int g = 0; g < kGV; ++g) {
        float add[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < kSN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float bv = vbi[(8 * n + 2 * t4 + (e & 1)) * kG + gv0 + g];
            add[e >> 1] += s[n][e] != 0.0f ? s[n][e] * bv : 0.0f;
          }
        }
        vbias[0][g] = vbias[0][g] * corr[0] + add[0];
        vbias[1][g] = vbias[1][g] * corr[1] + add[1];
      }

      // O += (P * scale_v) . codes, per 16-key step and group.
      const uint16_t* vrow =
          vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kStride + 8 * (lane >> 4) + dv0;
#pragma unroll
      for (int j = 0; j < kKS; ++j) {
#pragma unroll
        for (int g = 0; g < kGV; ++g) {
          float w[4][2]; // a-register order: (ra, keys lo), (rb, lo), (ra, hi), (rb, hi)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int n = 2 * j + (q >> 1), h = q & 1;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = s[n][2 * h + e];
              const float sc = vsc[(8 * n + 2 * t4 + e) * kG + gv0 + g];
              w[q][e] = p != 0.0f ? p * sc : 0.0f;
            }
          }
          uint32_t ahi[4], alo[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            ahi[q] = pack2<__nv_bfloat16>(w[q][0], w[q][1]);
            if constexpr (kTwoTerms) {
              alo[q] = bf16_rest(w[q][0], w[q][1], ahi[q]);
            }
          }
#pragma unroll
          for (int np = 0; np < GS / 16; ++np) {
            const int nt = g * (GS / 8) + 2 * np;
            uint32_t vb4[4];
            ldsm_x4_trans(vb4, vrow + j * 16 * kStride + nt * 8);
            mma<__nv_bfloat16>(acc[nt], ahi, vb4[0], vb4[1]);
            mma<__nv_bfloat16>(acc[nt + 1], ahi, vb4[2], vb4[3]);
            if constexpr (kTwoTerms) {
              mma<__nv_bfloat16>(acc[nt], alo, vb4[0], vb4[1]);
              mma<__nv_bfloat16>(acc[nt + 1], alo, vb4[2], vb4[3]);
            }
          }
        }
      }
    }
  }

  // Query fragments: the block's query rows (query heads x positions of one KV
  // head) into shared memory, zeros past the R live rows.
  __device__ __forceinline__ static void load_queries(
      const SdpaArgs& a,
      uint16_t* const& qs,
      const int& r0,
      const int& R,
      const int& kvh,
      const int& b) {
    for (int i = threadIdx.x; i < kRows * D; i += kThreads) {
      const int r = i / D, d = i % D;
      uint16_t v = 0;
      if (r < R) {
        const int rr = r0 + r, l = row_position(rr, a.rep), h = row_head(kvh, rr, a.rep);
        v = static_cast<const uint16_t*>(
            a.q)[b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2] + d * a.q_st[3]];
      }
      qs[r * kStride + d] = v;
    }
  }

  // Block merge: sums over the quad, then the output (one split) or this
  // split's partial and (max, sum) for merge_kernel.
  __device__ __forceinline__ static void write_output(
      const SdpaArgs& a,
      const int& b,
      const int& kvh,
      const int& tile,
      const int& split,
      const int& part,
      const int& wr0,
      const int& g8,
      const int& t4,
      const int& dv0,
      const bool (&live)[2],
      const int (&head)[2],
      const int (&lpos)[2],
      const float (&m)[2],
      float (&l)[2],
      float (&vbias)[2][kGV],
      const float (&acc)[kNT][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = lanes_sum<1, 2>(l[h]);
#pragma unroll
      for (int g = 0; g < kGV; ++g) {
        vbias[h][g] = lanes_sum<1, 2>(vbias[h][g]);
      }
    }
    const int64_t blk = ((int64_t(b) * a.Hkv + kvh) * a.row_tiles + tile) * a.splits + split;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!live[h]) {
        continue;
      }
      const int r = wr0 + g8 + 8 * h;
      const float m_nat = m[h] == -INFINITY ? -INFINITY : m[h] * kLn2;
      if (a.splits == 1 && !a.lse) {
        const float inv = output_scale(m_nat, l[h], a.sinks ? a.sinks + head[h] : nullptr);
        T* out = static_cast<T*>(a.out) + ((int64_t(b) * a.Hq + head[h]) * a.L + lpos[h]) * D + dv0;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float bv = vbias[h][nt * 8 / GS];
          const uint32_t v = pack2<T>((acc[nt][2 * h] + bv) * inv, (acc[nt][2 * h + 1] + bv) * inv);
          *reinterpret_cast<uint32_t*>(out + nt * 8 + 2 * t4) = v;
        }
      } else {
        float* po = a.part_o + (blk * a.row_tile + r) * D + dv0;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float bv = vbias[h][nt * 8 / GS];
          *reinterpret_cast<float2*>(po + nt * 8 + 2 * t4) =
              make_float2(acc[nt][2 * h] + bv, acc[nt][2 * h + 1] + bv);
        }
        if (t4 == 0 && part == 0) { // every part has the same (max, sum)
          a.part_ml[(blk * a.row_tile + r) * 2] = m_nat;
          a.part_ml[(blk * a.row_tile + r) * 2 + 1] = l[h];
        }
      }
    }
  }

  __device__ __forceinline__ static void run(const SdpaArgs& a) {
    extern __shared__ float4 smem4[];
    uint16_t* qs = reinterpret_cast<uint16_t*>(smem4); // [kRows][kStride], T
    uint16_t* ks = qs + kRows * kStride; // [kKeys][kStride], T (dequantized)
    uint16_t* vs = ks + kKeys * kStride; // [kKeys][kStride], bf16 codes
    float* vsc = reinterpret_cast<float*>(vs + kKeys * kStride); // [kKeys][kG]
    float* vbi = vsc + kKeys * kG;
    uint32_t* kraw = reinterpret_cast<uint32_t*>(vbi + kKeys * kG); // [kKeys][W]
    uint32_t* vraw = kraw + kKeys * D / 4;
    // [PARTS][WARPS][16 x KEYS] partial scores (dense: after the four row buffers)
    float* red = DENSE ? reinterpret_cast<float*>(ks + 4 * kKeys * kStride)
                       : reinterpret_cast<float*>(vraw + kKeys * D / 4);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int split = blockIdx.y;
    const int part = PARTS == 1 ? 0 : warp / WARPS; // this warp's output columns
    const int dv0 = part * DV, gv0 = part * kGV; // first output column, group
    const int tile = a.row_tiles - 1 - blockIdx.x / a.Hkv;
    const int kvh = blockIdx.x % a.Hkv, b = blockIdx.z;
    const int r0 = tile * a.row_tile;
    const int R = min(a.row_tile, a.rows - r0);
    const int shift = a.N - a.L; // causal: position l sees keys <= l + shift
    const int n0 = split * a.split_keys;
    int n1 = min(a.N, n0 + a.split_keys);
    if (a.mask_kind == kMaskCausal) {
      n1 = min(n1, row_position(r0 + R - 1, a.rep) + shift + 1);
    }

    load_queries(a, qs, r0, R, kvh, b);

    // This thread's rows (tile-local): ra = 16 warp + g8 and rb = ra + 8.
    const int wr0 = 16 * (PARTS == 1 ? warp : warp % WARPS);
    const bool warp_live = wr0 < R;
    int lim[2], lpos[2], head[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wr0 + g8 + 8 * h;
      live[h] = r < R;
      const int rr = r0 + (live[h] ? r : 0);
      lpos[h] = row_position(rr, a.rep);
      head[h] = row_head(kvh, rr, a.rep);
      lim[h] = a.mask_kind == kMaskCausal ? lpos[h] + shift : INT_MAX;
    }
    const int warp_first_lim = row_position(r0 + wr0, a.rep) + shift;
    const float scale2 = a.scale * kLog2e;

    const uint32_t* kw0 = a.kw + b * a.kw_st[0] + kvh * a.kw_st[1];
    const uint32_t* vw0 = a.vw + b * a.vw_st[0] + kvh * a.vw_st[1];
    const int64_t ks0 = b * a.ks_st[0] + kvh * a.ks_st[1];
    const int64_t kb0 = b * a.kb_st[0] + kvh * a.kb_st[1];
    const int64_t vs0 = b * a.vs_st[0] + kvh * a.vs_st[1];
    const int64_t vb0 = b * a.vb_st[0] + kvh * a.vb_st[1];
    const int bits = a.k_bits; // (= a.v_bits: the plan's tiled_candidate)
    const int W = D * bits / 32; // words per row

    // Running state of rows ra (index 0) and rb (1): max (log2 units), this
    // thread's share of the sum of weights and of sum(P * bias_v) per group,
    // and the output columns 8 nt + 2 t4 (+1).
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float vbias[2][kGV];
    float acc[kNT][4];
#pragma unroll
    for (int g = 0; g < kGV; ++g)
      vbias[0][g] = vbias[1][g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
      acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // Dense: two buffers of K and V rows where the words and the staged tile
    // sit otherwise; tile c0 + kKeys lands in one while c0 computes from the
    // other.
    uint16_t* const kbuf[2] = {ks, ks + 2 * kKeys * kStride};
    uint16_t* const vbuf[2] = {ks + kKeys * kStride, ks + 3 * kKeys * kStride};
    const int64_t base = (int64_t(b) * a.Hkv + kvh) * a.N * D;
    const uint16_t* kd0 = static_cast<const uint16_t*>(a.kd) + base;
    const uint16_t* vd0 = static_cast<const uint16_t*>(a.vd) + base;

    // One tile ahead: the next tile's words and scales (or dense rows) load
    // while this one computes.
    ScalesT sc;
    auto fetch = [&](int c0, int into) {
      if constexpr (DENSE) {
        fetch_dense(kd0, vd0, kbuf[into], vbuf[into], n1, c0);
      } else {
        fetch_words(a, kw0, vw0, kraw, vraw, W, n1, c0);
        fetch_scales(a, ks0, kb0, vs0, vb0, n1, sc, c0);
      }
    };
    if (n0 < n1) {
      fetch(n0, 0);
    }
    int cur = 0;
    for (int c0 = n0; c0 < n1; c0 += kKeys, cur ^= 1) {
      cp_async_wait_all();
      __syncthreads(); // the tile landed; the previous tile's readers are done
      if constexpr (!DENSE) {
        stage(kraw, vraw, ks, vs, vsc, vbi, W, bits, sc);
        __syncthreads();
      }
      if (c0 + kKeys < n1) {
        fetch(c0 + kKeys, cur ^ 1);
      }
      const uint16_t* kt = DENSE ? kbuf[cur] : ks;
      const uint16_t* vt = DENSE ? vbuf[cur] : vs;
      if (warp_live) {
        compute_tile(
            a,
            qs,
            kt,
            vt,
            vsc,
            vbi,
            lane,
            t4,
            wr0,
            b,
            n1,
            warp_first_lim,
            gv0,
            dv0,
            part,
            red,
            scale2,
            live,
            lim,
            head,
            lpos,
            m,
            l,
            vbias,
            acc,
            c0);
      }
    }

    write_output(
        a, b, kvh, tile, split, part, wr0, g8, t4, dv0, live, head, lpos, m, l, vbias, acc);
  }
};

// Two blocks of 4 warps per SM, one of 8 or more (a warp then may hold up to
// 255 registers, which the 128 output columns of a warp need).
template <typename T, int D, int GS, int WARPS, int KEYS, int PARTS, bool DENSE>
__global__ void __launch_bounds__(32 * WARPS * PARTS, WARPS* PARTS == 4 ? 2 : 1)
    tiled_kernel_impl(SdpaArgs a) {
  TiledStages<T, D, GS, WARPS, KEYS, PARTS, DENSE>::run(a);
}

// Queries, K/V rows (codes path: one staged tile plus its V scales and the
// next tile's words; dense: two tiles of K and V) and partial scores.
template <int D, int WARPS, int KEYS, int PARTS, bool DENSE>
constexpr int smem_bytes(int gs) {
  const int red = PARTS > 1 ? PARTS * WARPS * 16 * KEYS * 4 : 0;
  if constexpr (DENSE) {
    return (16 * WARPS + 4 * KEYS) * (D + 8) * 2 + red;
  }
  return (16 * WARPS + 2 * KEYS) * (D + 8) * 2 + 2 * KEYS * (D / gs) * 4 + 2 * KEYS * D + red;
}

template <typename T, int D, int GS, int WARPS, int KEYS, bool DENSE = false>
TiledKernel instance() {
  constexpr int kParts = D > 128 ? D / 128 : 1;
  return {
      handle<tiled_kernel_impl<T, D, GS, WARPS, KEYS, kParts, DENSE>>(),
      smem_bytes<D, WARPS, KEYS, kParts, DENSE>(GS),
      32 * WARPS * kParts,
      16 * WARPS,
      KEYS,
      DENSE};
}

// The dense-K/V instances (head dims 256 and 512; the group size plays no
// part, 64 fills the template).
template <typename T>
TiledKernel dense_for_dim(int D) {
  switch (D) {
    case 256:
      return instance<T, 256, 64, 4, 32, true>();
    case 512:
      return instance<T, 512, 64, 2, 32, true>();
    default:
      return {};
  }
}

// Block shapes (`warps` = row warps of 16 rows; MLXQ_CUDA_TILED_WARPS /
// MLXQ_CUDA_TILED_KEYS): 4 x 32 keys everywhere; head dim 128 also has 8-warp
// and 64-key variants, head dim 256 a 2-warp one, and 512 has only that one
// (with their column partners: 4 and 8 warps). On the H200 at L = N = 4096, 32/8/128, causal:
// 8 x 32 2.46 ms, 8 x 64 2.49, 4 x 32 2.94, 4 x 64 3.03.
template <typename T, int D, int GS>
TiledKernel by_block(int warps, int keys) {
  if constexpr (D == 512) { // 4 row warps would be 16 warps of 128 registers: spills
    return instance<T, D, GS, 2, 32>();
  } else if constexpr (D == 256) {
    return warps == 2 ? instance<T, D, GS, 2, 32>() : instance<T, D, GS, 4, 32>();
  } else if constexpr (D == 128) {
    if (warps == 8) {
      return keys == 64 ? instance<T, D, GS, 8, 64>() : instance<T, D, GS, 8, 32>();
    }
    return keys == 64 ? instance<T, D, GS, 4, 64>() : instance<T, D, GS, 4, 32>();
  } else {
    return instance<T, D, GS, 4, 32>();
  }
}

template <typename T, int D>
TiledKernel for_group(int gs, int warps, int keys) {
  switch (gs) {
    case 32:
      return by_block<T, D, 32>(warps, keys);
    case 64:
      return by_block<T, D, 64>(warps, keys);
    default:
      if constexpr (D >= 128) {
        return by_block<T, D, 128>(warps, keys);
      }
      return {};
  }
}

template <typename T>
TiledKernel for_dim(int D, int gs, int warps, int keys) {
  switch (D) {
    case 64:
      return for_group<T, 64>(gs, warps, keys);
    case 128:
      return for_group<T, 128>(gs, warps, keys);
    case 256:
      return for_group<T, 256>(gs, warps, keys);
    case 512:
      return for_group<T, 512>(gs, warps, keys);
    default:
      return {};
  }
}

} // namespace

TiledKernel tiled_kernel_f16(int D, int gs, int warps, int keys);
TiledKernel tiled_dense_kernel_f16(int D);

} // namespace mlxq::cuda
