// CUDA QuantizedSDPA, tensor-core decode path (4- and 8-bit codes, f16/bf16
// queries, few query rows per KV head: decode and short speculative drafts).
//
// Why this shape: decode reads every packed K/V byte once, so the kernel must
// stream at HBM speed. Dequantizing into shared memory (the generic kernel)
// costs more instructions than the bytes allow; here codes go from 16-byte
// coalesced global loads straight into the register fragments of bf16
// mma.sync.m16n8k16 (f32 accumulators):
//   * a pair of 4-bit codes becomes bf16 (128 + c) with one LOP3 (OR into
//     the mantissa of 128.0); the 128 comes back out of the sums once per
//     group (K: through the bias term, V: a ones . P' mma). 8-bit codes are
//     made exact (a second magic for the high nibble). No float conversions;
//   * scores: S = Q . K_codes^T per quantization group, with Q as the A
//     operand. Rows of A are (group slot, query row): the k dimension of one
//     mma mixes the dims of up to four groups, so each group's query values
//     sit in their own rows and the others are zero there. Then
//     s = scale_g * dot_g + bias_g * sum(q over g) (the qdot factoring);
//   * values: O^T = V_codes^T . P', P' = p * scale_g per group (bf16; the f16
//     path splits P' in a high and a low bf16 term), plus sum(p * bias_g);
//   * f16 queries are split exactly into two bf16 terms (8 + 3 bits).
// One warp owns 32 keys per step (16 for rows of 128 bytes or more): lane
// (q, t) loads 16 contiguous bytes of K row q of each 8-key slice, and for V
// the run of dims that its output rows need from 4 keys; the next step's
// loads are issued before this step computes. Scales and biases of a step
// are staged in shared memory with coalesced loads. Four warps per block
// share the query fragments and merge their online softmax states before one
// partial per block is written; merge_kernel then combines the key splits by
// log-sum-exp (and applies sinks).
#pragma once

#include <cfloat>
#include <type_traits>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

constexpr int kWarps = kMmaWarps;
// d += a . b on bf16 m16n8k16 tiles, the A fragment as one uint4.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint4 a, uint32_t b0, uint32_t b1) {
  const uint32_t regs[4] = {a.x, a.y, a.z, a.w};
  mma<__nv_bfloat16>(d, regs, b0, b1);
}

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ __nv_bfloat162 bf2(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// Two codes -> bf16x2 integers. Code A sits in bits [0, BITS) of x, code B
// in bits [16, 16 + BITS); other bits are ignored. OR-ing a 4-bit code into
// the mantissa of 128.0 gives 128 + c exactly (one instruction; the kernel
// takes the 128 back out of its sums, see kCodeOffset). 8-bit codes are made
// exact: 128 + low nibble and 256 + 16 * high nibble (the high nibble three
// bits up in the mantissa of 256.0, step 2), less 384, added.
template <int BITS>
constexpr float kCodeOffset = BITS == 4 ? 128.0f : 0.0f;

// (x & mask) | magic in one LOP3 (the compiler splits two immediates in two).
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(magic));
  return r;
}

template <int BITS>
__device__ __forceinline__ uint32_t code_pair(uint32_t x) {
  const uint32_t lo = and_or(x, 0x000F000Fu, 0x43004300u);
  if constexpr (BITS == 4) {
    return lo;
  } else {
    const uint32_t hi = and_or(x >> 1, 0x00780078u, 0x43804380u);
    return bf2_bits(__hadd2(__hsub2(bf2(lo), bf2(0x43004300u)),
                            __hsub2(bf2(hi), bf2(0x43804380u))));
  }
}

// The compile-time layout of one (bits, head dim, group size) instance.
template <int BITS, int D, int GS>
struct Shape {
  static constexpr int kRowBytes = D * BITS / 8;
  static constexpr int kChunks = kRowBytes / 64; // 64-byte chunks: 4 lanes x 16 B
  static constexpr int kChunkDims = 512 / BITS;
  static constexpr int kLaneDims = kChunkDims / 4; // per lane per chunk
  static constexpr int kWordDims = 32 / BITS;
  static constexpr int kStepsPerWord = kWordDims / 4; // k-steps of 4 codes
  static constexpr int kSteps = 4 * kStepsPerWord; // k-steps per chunk
  static constexpr int kSlots = kChunkDims / GS > 1 ? kChunkDims / GS : 1;
  static constexpr int kSlotRows = kSlots == 4 ? 4 : 8; // rows per slot
  static constexpr int kMaxRows = kSlotRows;
  static constexpr int kGroups = D / GS;
  static constexpr int kKeys = kRowBytes >= 128 ? 16 : 32; // keys per warp step
  static constexpr int kSlices = kKeys / 8; // 8-key mma n-tiles of K
  static constexpr int kVSteps = kKeys / 16; // 16-key mma k-steps of V
  static constexpr int kRunDims = GS / 8; // dims of one V run (per quad, group)
  static constexpr int kRunBytes = kRunDims * BITS / 8;
  static constexpr int kRunWords = kRunBytes >= 4 ? kRunBytes / 4 : 1;
  static constexpr int kTilesPerGroup = GS / 16; // V m-tiles per group
  static constexpr int kTiles = D / 16;
  static_assert(kRowBytes % 64 == 0, "rows must be whole 64-byte chunks");
  static_assert(GS % 32 == 0 && D % GS == 0, "unsupported group size");

  // Head dim of element e (0: k = 2t, 1: 2t+1, 2: 2t+8, 3: 2t+9) of the K
  // B-fragment of lane t in chunk c, k-step j.
  __device__ static int key_dim(int c, int t, int j, int e) {
    const int word = j / kStepsPerWord;
    const int s0 = 2 * (j % kStepsPerWord);
    const int idx = s0 + (e >> 1) + (e & 1) * (kWordDims / 2);
    return c * kChunkDims + t * kLaneDims + word * kWordDims + idx;
  }
  // Group of `slot` in chunk c.
  __device__ static int slot_group(int c, int slot) {
    return (c * kChunkDims + slot * (kChunkDims / kSlots)) / GS;
  }
};

// One V run (the dims a quad needs from one key and group) as 32-bit words,
// with the widest load its size allows.
template <int BYTES>
__device__ __forceinline__ void load_run(const uint8_t* p, uint32_t* w) {
  if constexpr (BYTES == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (BYTES == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  }
}

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    return __bfloat162float(v);
  }
}

// What one warp step reads from global memory: its K words (lane: 16 bytes
// of key 8n + q per chunk), its V runs (keys 2t, 2t+1, 2t+8, 2t+9 of each
// 16 keys) and a coalesced share of the step's scales and biases. Loaded one
// step ahead of its use, so a warp's loads are in flight while it computes.
template <int BITS, int D, int GS>
struct Step {
  using S = Shape<BITS, D, GS>;
  static constexpr int kStaged = S::kKeys * S::kGroups;
  static constexpr int kStage = (kStaged + 31) / 32;
  uint4 kw[S::kSlices][S::kChunks];
  uint32_t vw[S::kVSteps][4][S::kGroups][S::kRunWords];
  float ks[kStage], kb[kStage], vs[kStage], vb[kStage];
};

// Where a step's data lives: bases at (batch, KV head), strides within a
// head in elements (32-bit: the host sends heads of 2^31 bytes or more to the
// generic kernel).
template <typename ST>
struct Views {
  const uint8_t *k, *v;
  int krow, vrow; // bytes
  const ST *ks, *kb, *vs, *vb;
  int ks_row, kb_row, vs_row, vb_row, ks_g, kb_g, vs_g, vb_g;
};

template <int BITS, int D, int GS, typename ST>
__device__ __forceinline__ void load_step(
    Step<BITS, D, GS>& st, int k0, int N, int lane, const Views<ST>& w) {
  using S = Shape<BITS, D, GS>;
  using StepT = Step<BITS, D, GS>;
  const int q = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < S::kSlices; ++n) {
    const uint8_t* p = w.k + min(k0 + n * 8 + q, N - 1) * w.krow + 16 * t;
#pragma unroll
    for (int c = 0; c < S::kChunks; ++c) {
      st.kw[n][c] = *reinterpret_cast<const uint4*>(p + c * 64);
    }
  }
#pragma unroll
  for (int s = 0; s < S::kVSteps; ++s) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = min(k0 + 16 * s + 2 * t + (e & 1) + (e >> 1) * 8, N - 1);
      const uint8_t* p = w.v + key * w.vrow + q * S::kRunDims * BITS / 8;
#pragma unroll
      for (int g = 0; g < S::kGroups; ++g) {
        load_run<S::kRunBytes>(p + g * GS * BITS / 8, st.vw[s][e][g]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < StepT::kStage; ++u) {
    const int i = min(lane + 32 * u, StepT::kStaged - 1);
    const int key = min(k0 + i / S::kGroups, N - 1), g = i % S::kGroups;
    const float sk = to_f32(w.ks[key * w.ks_row + g * w.ks_g]);
    st.ks[u] = sk;
    // The K bias as the scores use it: less the codes' offset times the scale.
    st.kb[u] = to_f32(w.kb[key * w.kb_row + g * w.kb_g]) - kCodeOffset<BITS> * sk;
    st.vs[u] = to_f32(w.vs[key * w.vs_row + g * w.vs_g]);
    st.vb[u] = to_f32(w.vb[key * w.vb_row + g * w.vb_g]);
  }
}

template <int BITS, int D, int GS, typename ST, bool kTwoTerms>
__global__ void __launch_bounds__(kWarps * 32, 2) qsdpa_mma_kernel(SdpaArgs a) {
  using S = Shape<BITS, D, GS>;
  using StepT = Step<BITS, D, GS>;
  constexpr float kOff = kCodeOffset<BITS>; // codes come out as kOff + c
  extern __shared__ float4 smem4[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = lane >> 2, t = lane & 3;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int R = a.rows;
  constexpr bool two_terms = kTwoTerms; // f16 q: q and P' as hi + lo bf16

  // Shared memory: query fragments, per-row sums of q per group, per-warp
  // scale staging, and the block merge buffers.
  uint4* qfrag = reinterpret_cast<uint4*>(smem4); // [2][chunks][steps][32]
  float* qsum = reinterpret_cast<float*>(qfrag + 2 * S::kChunks * S::kSteps * 32);
  float* stage = qsum + S::kMaxRows * S::kGroups; // [warps][4][keys][groups]
  float* wm = stage + kWarps * 4 * S::kKeys * S::kGroups; // [warps][rows]
  float* wl = wm + kWarps * S::kMaxRows;
  float* obuf = wl + kWarps * S::kMaxRows; // [rows][D]

  auto qval = [&](int r, int d) {
    const int l = r / a.rep, h = kvh * a.rep + r % a.rep;
    const int64_t i = b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2] + d * a.q_st[3];
    return load_float(a.q, i, a.q_dtype);
  };
  // Row rho of the A operand -> (slot, query row).
  auto row_slot = [](int rho) { return rho / S::kSlotRows; };
  auto row_query = [](int rho) { return rho % S::kSlotRows; };

  for (int i = threadIdx.x; i < S::kChunks * S::kSteps * 32 * 4; i += blockDim.x) {
    const int reg = i & 3, ln = (i >> 2) & 31, cj = i >> 7;
    const int c = cj / S::kSteps, j = cj % S::kSteps;
    const int lq = ln >> 2, lt = ln & 3;
    const int rho = (reg & 1) ? lq + 8 : lq;
    const int lane_slot = lt / (4 / S::kSlots);
    const int r = row_query(rho);
    const bool live = row_slot(rho) == lane_slot && r < R;
    uint32_t hi = 0, lo = 0;
    for (int half = 0; half < 2; ++half) {
      const int e = (reg >> 1) * 2 + half;
      const float v = live ? qval(r, S::key_dim(c, lt, j, e)) : 0.0f;
      const __nv_bfloat16 vh = __float2bfloat16_rn(v);
      const __nv_bfloat16 vl = __float2bfloat16_rn(v - __bfloat162float(vh));
      hi |= uint32_t(*reinterpret_cast<const uint16_t*>(&vh)) << (16 * half);
      lo |= uint32_t(*reinterpret_cast<const uint16_t*>(&vl)) << (16 * half);
    }
    reinterpret_cast<uint32_t*>(qfrag)[(cj * 32 + ln) * 4 + reg] = hi;
    reinterpret_cast<uint32_t*>(qfrag + S::kChunks * S::kSteps * 32)[(cj * 32 + ln) * 4 + reg] =
        lo;
  }
  for (int i = threadIdx.x; i < S::kMaxRows * S::kGroups; i += blockDim.x) {
    const int r = i / S::kGroups, g = i % S::kGroups;
    float s = 0.0f;
    if (r < R) {
      for (int d = g * GS; d < (g + 1) * GS; ++d) {
        s += qval(r, d);
      }
    }
    qsum[i] = s;
  }
  for (int i = threadIdx.x; i < S::kMaxRows * D; i += blockDim.x) {
    obuf[i] = 0.0f;
  }
  __syncthreads();

  Views<ST> views;
  views.k = reinterpret_cast<const uint8_t*>(a.kw + b * a.kw_st[0] + kvh * a.kw_st[1]);
  views.v = reinterpret_cast<const uint8_t*>(a.vw + b * a.vw_st[0] + kvh * a.vw_st[1]);
  views.krow = int(a.kw_st[2] * 4);
  views.vrow = int(a.vw_st[2] * 4);
  views.ks = static_cast<const ST*>(a.ks) + b * a.ks_st[0] + kvh * a.ks_st[1];
  views.kb = static_cast<const ST*>(a.kb) + b * a.kb_st[0] + kvh * a.kb_st[1];
  views.vs = static_cast<const ST*>(a.vs) + b * a.vs_st[0] + kvh * a.vs_st[1];
  views.vb = static_cast<const ST*>(a.vb) + b * a.vb_st[0] + kvh * a.vb_st[1];
  views.ks_row = int(a.ks_st[2]), views.kb_row = int(a.kb_st[2]);
  views.vs_row = int(a.vs_st[2]), views.vb_row = int(a.vb_st[2]);
  views.ks_g = int(a.ks_st[3]), views.kb_g = int(a.kb_st[3]);
  views.vs_g = int(a.vs_st[3]), views.vb_g = int(a.vb_st[3]);
  const int N = a.N;

  // This lane's query row and its visible-key limit.
  const int my_r = row_query(q);
  const bool my_live = my_r < R;
  const int qrow = my_live ? my_r : 0;
  const int limit = a.mask_kind == 1 ? N - a.L + qrow / a.rep : N - 1;
  const float scale2 = a.scale * kLog2e;

  // Running state of this lane's row (max in log2 units; sum p per lane,
  // reduced over the quad at the end) and of its output columns (rows 2t,
  // 2t + 1): O^T tiles, sum p * V bias per group, and for 4-bit codes the
  // sum of the P' fed to the tensor cores (ones . P'), which times 128 is
  // the codes' offset to take out.
  float m = -INFINITY, l = 0.0f;
  float vbias[S::kGroups];
  float acc[S::kTiles][4];
  float poff[S::kGroups][4];
#pragma unroll
  for (int g = 0; g < S::kGroups; ++g) {
    vbias[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) poff[g][e] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < S::kTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  }
  const uint4 ones = make_uint4(0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u);

  float* st = stage + warp * 4 * S::kKeys * S::kGroups;
  float* st_ks = st;
  float* st_kb = st + S::kKeys * S::kGroups;
  float* st_vs = st + 2 * S::kKeys * S::kGroups;
  float* st_vb = st + 3 * S::kKeys * S::kGroups;

  auto process = [&](const StepT& cur, int k0) {
    __syncwarp();
#pragma unroll
    for (int u = 0; u < StepT::kStage; ++u) {
      if (StepT::kStaged % 32 != 0 && lane + 32 * u >= StepT::kStaged) {
        break;
      }
      st_ks[lane + 32 * u] = cur.ks[u];
      st_kb[lane + 32 * u] = cur.kb[u];
      st_vs[lane + 32 * u] = cur.vs[u];
      st_vb[lane + 32 * u] = cur.vb[u];
    }
    __syncwarp();

    // Scores of this lane's row at keys 8n + 2t + e.
    float s[S::kSlices][2];
#pragma unroll
    for (int n = 0; n < S::kSlices; ++n) s[n][0] = s[n][1] = 0.0f;
#pragma unroll
    for (int c = 0; c < S::kChunks; ++c) {
      float d[S::kSlices][4];
#pragma unroll
      for (int n = 0; n < S::kSlices; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
#pragma unroll
      for (int j = 0; j < S::kSteps; ++j) {
        const uint4 a_hi = qfrag[(c * S::kSteps + j) * 32 + lane];
        uint4 a_lo = a_hi;
        if constexpr (two_terms) {
          a_lo = qfrag[((S::kChunks + c) * S::kSteps + j) * 32 + lane];
        }
        const int word = j / S::kStepsPerWord;
        const int s0 = 2 * (j % S::kStepsPerWord);
#pragma unroll
        for (int n = 0; n < S::kSlices; ++n) {
          const uint32_t w = (&cur.kw[n][c].x)[word];
          const uint32_t b0 = code_pair<BITS>(w >> (BITS * s0));
          const uint32_t b1 = code_pair<BITS>(w >> (BITS * (s0 + 1)));
          mma_bf16(d[n], a_hi, b0, b1);
          if constexpr (two_terms) {
            mma_bf16(d[n], a_lo, b0, b1);
          }
        }
      }
      const int g0 = S::slot_group(c, row_slot(q));
      const int g1 = S::slot_group(c, row_slot(q + 8));
#pragma unroll
      for (int n = 0; n < S::kSlices; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kl = n * 8 + 2 * t + e;
          s[n][e] += st_ks[kl * S::kGroups + g0] * d[n][e];
          if (row_slot(q + 8) < S::kSlots) {
            s[n][e] += st_ks[kl * S::kGroups + g1] * d[n][2 + e];
          }
        }
      }
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < S::kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = s[n][e];
        if constexpr (S::kSlots == 4) {
          v += __shfl_xor_sync(0xffffffffu, v, 16); // the other two slots
        }
        const int kl = n * 8 + 2 * t + e;
#pragma unroll
        for (int g = 0; g < S::kGroups; ++g) {
          v += st_kb[kl * S::kGroups + g] * qsum[qrow * S::kGroups + g];
        }
        const int key = k0 + kl;
        const bool visible = my_live && key < N && key <= limit;
        s[n][e] = visible ? v * scale2 : -INFINITY;
        tile_max = fmaxf(tile_max, s[n][e]);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));

    // Online softmax (log2 domain). Rescaling is skipped while no row's
    // max moved (most steps once the first keys are seen).
    const float m_new = fmaxf(m, tile_max);
    const float corr = m_new == -INFINITY ? 1.0f : exp2f(m - m_new);
    m = m_new;
    float p[S::kSlices][2];
    float psum = 0.0f;
#pragma unroll
    for (int n = 0; n < S::kSlices; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[n][e] = m_new == -INFINITY ? 0.0f : exp2f(s[n][e] - m_new);
        psum += p[n][e];
      }
    }
    l = l * corr + psum;
#pragma unroll
    for (int g = 0; g < S::kGroups; ++g) {
      float add = 0.0f;
#pragma unroll
      for (int n = 0; n < S::kSlices; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kl = n * 8 + 2 * t + e;
          add += p[n][e] != 0.0f ? p[n][e] * st_vb[kl * S::kGroups + g] : 0.0f;
        }
      }
      vbias[g] = vbias[g] * corr + add;
    }
    if (__any_sync(0xffffffffu, corr != 1.0f)) {
      // Output columns of this lane are query rows 2t and 2t + 1.
      const float c0 = __shfl_sync(0xffffffffu, corr, (2 * t) * 4);
      const float c1 = __shfl_sync(0xffffffffu, corr, (2 * t + 1) * 4);
#pragma unroll
      for (int i = 0; i < S::kTiles; ++i) {
        acc[i][0] *= c0;
        acc[i][1] *= c1;
        acc[i][2] *= c0;
        acc[i][3] *= c1;
      }
#pragma unroll
      for (int g = 0; g < S::kGroups; ++g) {
        poff[g][0] *= c0;
        poff[g][1] *= c1;
        poff[g][2] *= c0;
        poff[g][3] *= c1;
      }
    }

    // O^T += V_codes^T . P' per group.
    const bool col_live = q < R; // B column n = q is query row q
#pragma unroll
    for (int sv2 = 0; sv2 < S::kVSteps; ++sv2) {
#pragma unroll
      for (int g = 0; g < S::kGroups; ++g) {
        float w4[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = 2 * sv2 + (e >> 1);
          const float pe = p[n][e & 1];
          const int kl = n * 8 + 2 * t + (e & 1);
          w4[e] = col_live && pe != 0.0f ? pe * st_vs[kl * S::kGroups + g] : 0.0f;
        }
        uint32_t bh[2], bl[2] = {0u, 0u};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const __nv_bfloat162 x = __floats2bfloat162_rn(w4[2 * h], w4[2 * h + 1]);
          bh[h] = bf2_bits(x);
          if constexpr (two_terms) {
            const float2 xf = __bfloat1622float2(x);
            bl[h] = bf2_bits(__floats2bfloat162_rn(w4[2 * h] - xf.x, w4[2 * h + 1] - xf.y));
          }
        }
        if constexpr (kOff != 0.0f) {
          mma_bf16(poff[g], ones, bh[0], bh[1]);
          if constexpr (two_terms) {
            mma_bf16(poff[g], ones, bl[0], bl[1]);
          }
        }
        // Byte-permute puts the bytes of run positions into half words: key
        // 2t (or 2t + 8) low, key 2t + 1 (2t + 9) high. One permute covers
        // two m-tiles of 4-bit codes (4 codes a byte pair) or one of 8-bit.
        constexpr int kTilesPerPerm = BITS == 4 ? 2 : 1;
#pragma unroll
        for (int jp = 0; jp < S::kTilesPerGroup; jp += kTilesPerPerm) {
          const int bit = 2 * jp * BITS;
          const int word = bit / 32, byte = (bit % 32) / 8;
          const uint32_t sel = byte | ((byte + 1) << 4) | ((byte + 4) << 8) | ((byte + 5) << 12);
          const uint32_t x01 = __byte_perm(cur.vw[sv2][0][g][word], cur.vw[sv2][1][g][word], sel);
          const uint32_t x89 = __byte_perm(cur.vw[sv2][2][g][word], cur.vw[sv2][3][g][word], sel);
#pragma unroll
          for (int jj = 0; jj < kTilesPerPerm; ++jj) {
            const int j = jp + jj;
            uint32_t areg[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) { // h = 0: row q (run code 2j); 1: row q + 8
              const int shift = (2 * jj + h) * BITS;
              areg[h] = code_pair<BITS>(x01 >> shift);
              areg[2 + h] = code_pair<BITS>(x89 >> shift);
            }
            const uint4 av = make_uint4(areg[0], areg[1], areg[2], areg[3]);
            mma_bf16(acc[g * S::kTilesPerGroup + j], av, bh[0], bh[1]);
            if constexpr (two_terms) {
              mma_bf16(acc[g * S::kTilesPerGroup + j], av, bl[0], bl[1]);
            }
          }
        }
      }
    }
  };

  // Two step buffers in turn: the next step loads while this one computes.
  const int split_begin = blockIdx.x * a.split_keys;
  const int split_end = min(N, split_begin + a.split_keys);
  constexpr int kStride = kWarps * S::kKeys;
  int k0 = split_begin + warp * S::kKeys;
  StepT buf0, buf1;
  if (k0 < split_end) {
    load_step(buf0, k0, N, lane, views);
  }
  while (k0 < split_end) {
    if (k0 + kStride < split_end) {
      load_step(buf1, k0 + kStride, N, lane, views);
    }
    process(buf0, k0);
    k0 += kStride;
    if (k0 >= split_end) {
      break;
    }
    if (k0 + kStride < split_end) {
      load_step(buf0, k0 + kStride, N, lane, views);
    }
    process(buf1, k0);
    k0 += kStride;
  }

  // Block merge of the four warps' states, then one partial per block.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
  for (int g = 0; g < S::kGroups; ++g) {
    vbias[g] += __shfl_xor_sync(0xffffffffu, vbias[g], 1);
    vbias[g] += __shfl_xor_sync(0xffffffffu, vbias[g], 2);
  }
  if (t == 0 && q < S::kMaxRows && row_query(q) == q) {
    wm[warp * S::kMaxRows + q] = m;
    wl[warp * S::kMaxRows + q] = l;
  }
  __syncthreads();
  // Each warp's weight for rows 2t, 2t + 1 (its output columns).
  float wgt[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    float mb = -INFINITY;
    if (r < R) {
      for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, wm[w * S::kMaxRows + r]);
    }
    const float mw = r < R ? wm[warp * S::kMaxRows + r] : -INFINITY;
    wgt[e] = mw == -INFINITY ? 0.0f : exp2f(mw - mb);
  }
#pragma unroll
  for (int g = 0; g < S::kGroups; ++g) {
    const float b0 = __shfl_sync(0xffffffffu, vbias[g], (2 * t) * 4);
    const float b1 = __shfl_sync(0xffffffffu, vbias[g], (2 * t + 1) * 4);
#pragma unroll
    for (int j = 0; j < S::kTilesPerGroup; ++j) {
      const int i = g * S::kTilesPerGroup + j;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = g * GS + q * S::kRunDims + 2 * j + h;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 2 * t + e;
          if (r < R && wgt[e] > 0.0f) {
            const float off = kOff * poff[g][2 * h + e]; // the codes' offset
            atomicAdd(&obuf[r * D + d], wgt[e] * (acc[i][2 * h + e] - off + (e ? b1 : b0)));
          }
        }
      }
    }
  }
  __syncthreads();
  const int64_t blk = (int64_t(b) * a.Hkv + kvh) * a.splits + blockIdx.x;
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    a.part_o[blk * R * D + i] = obuf[i];
  }
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    float mb = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, wm[w * S::kMaxRows + r]);
    float lb = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wm[w * S::kMaxRows + r];
      lb += mw == -INFINITY ? 0.0f : exp2f(mw - mb) * wl[w * S::kMaxRows + r];
    }
    a.part_ml[(blk * R + r) * 2] = mb == -INFINITY ? -INFINITY : mb * kLn2;
    a.part_ml[(blk * R + r) * 2 + 1] = lb;
  }
}

template <int BITS, int D, int GS>
int smem_of() {
  using S = Shape<BITS, D, GS>;
  const int frag = 2 * S::kChunks * S::kSteps * 32 * 16;
  const int floats = S::kMaxRows * S::kGroups + kWarps * 4 * S::kKeys * S::kGroups +
                     2 * kWarps * S::kMaxRows + S::kMaxRows * D;
  return frag + floats * 4;
}

template <int BITS, int D, int GS, bool kTwo>
void* by_scale_dtype(int scale_dtype) {
  switch (scale_dtype) {
    case kF16: return handle<qsdpa_mma_kernel<BITS, D, GS, __half, kTwo>>();
    case kBF16: return handle<qsdpa_mma_kernel<BITS, D, GS, __nv_bfloat16, kTwo>>();
    default: return handle<qsdpa_mma_kernel<BITS, D, GS, float, kTwo>>();
  }
}

template <int BITS, int D, int GS>
MmaKernel instance(int scale_dtype, int q_dtype) {
  MmaKernel k{nullptr, smem_of<BITS, D, GS>(), Shape<BITS, D, GS>::kMaxRows,
              Shape<BITS, D, GS>::kKeys * kWarps};
  k.fn = q_dtype == kBF16 ? by_scale_dtype<BITS, D, GS, false>(scale_dtype)
                          : by_scale_dtype<BITS, D, GS, true>(scale_dtype);
  return k;
}

} // namespace

MmaKernel sdpa_mma_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype);
MmaKernel sdpa_mma_kernel_8bit(int D, int gs, int scale_dtype, int q_dtype);

} // namespace mlxq::cuda
