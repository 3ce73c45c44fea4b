// CUDA QuantizedSDPA, tensor-core decode path (4- and 8-bit codes, K and V
// of one width or 8-bit keys with 4-bit values, f16/bf16 queries, at most 8
// query rows per block: decode and short drafts; a decode step with more
// query heads per KV head runs as groups of them, plan.h's head_groups).
//
// Why this shape: decode reads every packed K/V byte once, so the kernel must
// stream at HBM speed with enough bytes in flight and few instructions per
// byte. Codes go from coalesced cp.async copies through shared memory
// (ldmatrix) straight into mma.sync.m16n8k16 fragments (f32 accumulators);
// nothing is dequantized element by element.
//
// Scores, S^T = K . Q^T with 16 keys as the M rows and the query rows as the
// 8 columns. K codes become f16 (1024 + c) with one LOP3 per pair: the low
// nibble of a byte in place, the high nibble as 1024 + 16 c whose query
// value is pre-divided by 16, so a 32-bit word of eight 4-bit codes costs one
// shift and four LOP3s; 8-bit codes are one PRMT per pair. Each k-step of 16
// dims lies in one quantization group (a lane's words of a key are within
// one group), so per-group dot products accumulate separately and
//   s = sum_g scale_g * (dot_g - 1024 * sum of the fed q) + bias_g * qsum_g.
// Queries are scaled per row by a power of two into f16 range (exact for
// bf16 and f16 values) and the scores take the factor back out.
//
// Values, O^T = V_codes^T . P'^T per group with P' = p * scale_g (bf16; f16
// queries add a low bf16 term), V codes as bf16 (128 + c) as before, the
// 128 offset taken back out through a ones . P' mma, and sum(p * bias_g) in
// f32. The score fragment (keys x rows) becomes P's B fragment (rows x keys)
// with two movmatrix transposes per 16 keys.
//
// A warp owns 16 or 32 keys per step and streams its steps through a ring
// of cp.async stages, several steps ahead: the codes and, raw as stored, the
// step's scales and biases (read per key from shared memory; as far ahead as
// the codes, since under full HBM load a one-step lookahead stalled). Four warps per block merge
// their online softmax states into one partial per block; the last block of a KV head to finish
// combines the key splits by log-sum-exp and applies sinks (sdpa/merge.cuh), or merge_kernel does
// when the host gives no counters. A cache's exact recent window, when the
// step has one, is attended by extra blocks of each KV head (attend_recent)
// whose partials that merge folds in.
#pragma once

#include <cfloat>
#include <type_traits>

#include "cuda/device_utils.cuh"
#include "cuda/sdpa/merge.cuh"

namespace mlxq::cuda {

namespace {

constexpr int kWarps = kDecodeWarps;

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ __nv_bfloat162 bf2(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

__device__ __forceinline__ uint32_t h2_bits(__half2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// (x & mask) | magic in one LOP3 (the compiler splits two immediates in two).
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(magic));
  return r;
}

// Transposes an 8x8 matrix of 16-bit values held one row pair per lane.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

constexpr uint32_t kF16Magic = 0x64006400u; // f16 1024.0 twice: 1024 + c

// How far (log2 units) a row's scores may pass its running max before the
// max moves and the state is rescaled.
constexpr float kMaxSlack = 8.0f;

// V codes -> bf16x2 integers. Code A sits in bits [0, BITS) of x, code B in
// bits [16, 16 + BITS). A 4-bit code OR-ed into the mantissa of 128.0 gives
// 128 + c (one instruction; the kernel takes the 128 back out of its sums).
// 8-bit codes are made exact: 128 + low nibble and 256 + 16 * high nibble
// less 384, added.
template <int BITS>
constexpr float kVOffset = BITS == 4 ? 128.0f : 0.0f;

template <int BITS>
__device__ __forceinline__ uint32_t v_code_pair(uint32_t x) {
  const uint32_t lo = and_or(x, 0x000F000Fu, 0x43004300u);
  if constexpr (BITS == 4) {
    return lo;
  } else {
    const uint32_t hi = and_or(x >> 1, 0x00780078u, 0x43804380u);
    return bf2_bits(
        __hadd2(__hsub2(bf2(lo), bf2(0x43004300u)), __hsub2(bf2(hi), bf2(0x43804380u))));
  }
}

// 16-byte slot of chunk c of row r of one operand's rows in a stage (rows
// of kChunks chunks): XOR-swizzled so the 8 rows an ldmatrix reads at one
// chunk hit distinct banks.
template <int kChunks>
struct Swizzle {
  static constexpr int kRowsPerSwz = kChunks >= 8 ? 1 : 8 / kChunks;
  static_assert((16 / kRowsPerSwz) % kChunks == 0, "the swizzle must repeat every 16 rows");
  __device__ static int slot(int r, int c) {
    return r * kChunks + (c ^ ((r / kRowsPerSwz) & (kChunks - 1)));
  }
};

// The compile-time layout of one instance: KB-bit keys in groups of KGS,
// VB-bit values in groups of VGS, head dim D, scales of type ST. A packed
// row is a whole number of 16-byte chunks; a chunk lies in one group (32
// dims of 4-bit codes, 16 of 8-bit), and a K chunk feeds the score mma
// through lane t's word t.
template <int KB, int VB, int D, int KGS, int VGS, typename ST>
struct Shape {
  // Keys: the scores' operand.
  static constexpr int kKRow = D * KB / 8; // bytes of a packed key row
  static constexpr int kKChunks = kKRow / 16;
  static constexpr int kKGroups = D / KGS;
  static constexpr int kKSteps = D / 16; // 16-dim k-steps of the scores
  static constexpr int kGroupKSteps = KGS / 16;
  static constexpr int kChunkKSteps = KB == 4 ? 2 : 1;
  // Values: the output's operand.
  static constexpr int kVRow = D * VB / 8;
  static constexpr int kVChunks = kVRow / 16;
  static constexpr int kVChunkDims = 128 / VB;
  static constexpr int kVGroups = D / VGS;
  static constexpr int kVChunksPerGroup = VGS / kVChunkDims;
  static constexpr int kTilesPerChunk = kVChunkDims / 16; // V m-tiles (16 dims)
  static constexpr int kVTiles = D / 16;
  static constexpr bool kSameGroups = kKGroups == kVGroups;
  static constexpr int kKeyTiles =
      (kKRow > kVRow ? kKRow : kVRow) <= 64 ? 2 : 1; // 16-key tiles per warp step
  static constexpr int kKeys = 16 * kKeyTiles;
  static constexpr int kMaxRows = 8;
  // Query fragments live in registers up to D = 128, in shared memory above
  // (registers would spill there).
  static constexpr bool kQInSmem = D > 128;
  static constexpr int kQSmemBytes = kQInSmem ? kKSteps * 32 * 8 : 0;
  // A step in shared memory: K and V codes, then the step's K scales, K
  // biases, V scales and V biases as stored ([kKeys][groups] each, copied
  // raw, so they arrive as far ahead as the codes). Steps in flight per
  // warp: enough bytes to cover HBM latency under load with 12 warps per SM.
  static constexpr int kCodeBytes = kKeys * (kKRow + kVRow);
  static constexpr int kKScaleBytes = kKeys * kKGroups * int(sizeof(ST)); // one K array
  static constexpr int kVScaleBytes = kKeys * kVGroups * int(sizeof(ST));
  static constexpr int kScaleChunks = 2 * (kKScaleBytes + kVScaleBytes) / 16; // 16-byte copies
  static constexpr int kScaleCopies = (kScaleChunks + 31) / 32; // per lane
  static constexpr int kStepBytes = kCodeBytes + 2 * (kKScaleBytes + kVScaleBytes);
  // A block's shared memory with s ring stages (query fragments, rings,
  // per-warp max/sum, 16 static bytes) and how many such blocks an H100/H200
  // SM holds (228 KB, 1 KB reserved per block, 128-byte granules; at most
  // kMinBlocks, the register budget of the launch bounds). 4 stages unless 3
  // fit more blocks: more warps to hide latency with about the same bytes in
  // flight. Head dim 512 gets 2 blocks' registers (255 per thread): with 3 it
  // spilled ~1.8 KB per thread, and its shared memory allows at most 2.
  static constexpr int kMinBlocks = D > 256 ? 2 : 3;
  static constexpr int block_smem(int s) {
    return kQSmemBytes + s * kWarps * kStepBytes + 2 * kWarps * kMaxRows * 4 + 16;
  }
  static constexpr int blocks_per_sm(int s) {
    const int by_smem = (228 * 1024) / ((block_smem(s) + 1024 + 127) / 128 * 128);
    return by_smem < kMinBlocks ? by_smem : kMinBlocks;
  }
  static constexpr int kStages = blocks_per_sm(4) >= blocks_per_sm(3) ? 4 : 3;
  static_assert(
      KGS % 32 == 0 && VGS % 32 == 0 && D % KGS == 0 && D % VGS == 0,
      "unsupported groups");
  static_assert(kKChunks >= 2 && kVChunks >= 2, "unsupported head dim");
  static_assert(
      kKScaleBytes % 16 == 0 && kVScaleBytes % 16 == 0,
      "a step's scales must be whole 16-byte chunks");
  using KSwizzle = Swizzle<kKChunks>;
  using VSwizzle = Swizzle<kVChunks>;

  // Head dim of element e (0: k = 2t, 1: 2t + 1, 2: 2t + 8, 3: 2t + 9) of the
  // K fragments of lane t in k-step j of group g, and whether the code sits
  // there as 16 c (the high nibble of a byte, 4-bit).
  __device__ static int key_dim(int t, int g, int j, int e) {
    const int J = g * kGroupKSteps + j;
    if constexpr (KB == 4) {
      constexpr int kOff[4] = {0, 4, 1, 5};
      return 8 * (4 * (J >> 1) + t) + 2 * (J & 1) + kOff[e];
    } else {
      constexpr int kOff[4] = {0, 2, 1, 3};
      return 4 * (4 * J + t) + kOff[e];
    }
  }
  __device__ static constexpr bool high_nibble(int e) {
    return KB == 4 && e >= 2;
  }
};

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

// G scales (or biases) of one key from a stage, as floats: one shared load
// of G * sizeof(ST) bytes (naturally aligned: rows are G elements).
template <int G, typename ST>
__device__ __forceinline__ void load_row(const ST* p, float* out) {
  if constexpr (std::is_same_v<ST, float>) {
#pragma unroll
    for (int g = 0; g < G; g += (G >= 4 ? 4 : G)) {
      if constexpr (G >= 4) {
        const float4 v = *reinterpret_cast<const float4*>(p + g);
        out[g] = v.x, out[g + 1] = v.y, out[g + 2] = v.z, out[g + 3] = v.w;
      } else if constexpr (G == 2) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        out[0] = v.x, out[1] = v.y;
      } else {
        out[0] = *p;
      }
    }
  } else if constexpr (G == 1) {
    out[0] = to_f32(*p);
  } else {
    // Pairs of 16-bit values in 32-bit words.
    uint32_t w[G / 2];
    if constexpr (G == 2) {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
#pragma unroll
      for (int i = 0; i < G / 2; i += 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p + 2 * i);
        w[i] = v.x, w[i + 1] = v.y;
      }
    }
#pragma unroll
    for (int i = 0; i < G / 2; ++i) {
      if constexpr (std::is_same_v<ST, __half>) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      } else {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    }
  }
}

// Where a step's data lives: bases at (batch, KV head). Rows are dense (the
// host sends other layouts to the generic kernel): a key's packed row is
// D * KB / 8 bytes, its scales and biases D / KGS consecutive elements (a
// value's the same with VB and VGS). So every load of a step is one base
// plus a compile-time offset.
template <typename ST>
struct Views {
  const uint8_t *k, *v;
  const ST *ks, *kb, *vs, *vb;
};

// One 16-byte chunk of a step's scales (or biases) into shared memory:
// `bytes` of it from `src`, the rest zeros. A head's scales need not start
// 16-byte aligned (a per-head stride of N * G elements often does not); all
// of its steps share the misalignment `mis` (a step starts a multiple of 16
// bytes in). 4-byte aligned sources take four 4-byte async copies; 2-byte
// aligned ones (16-bit scales, odd per-head counts) plain loads and stores.
// `head` is the head's first element: 0-byte copies point there.
template <int kItemBytes>
__device__ __forceinline__ void
copy_scale_chunk(uint32_t dst, const uint8_t* src, const uint8_t* head, int bytes, int mis) {
  if (mis == 0) {
    cp_async_zfill<16>(dst, bytes > 0 ? src : head, bytes);
  } else if (kItemBytes == 4 || mis % 4 == 0) { // f32 heads are always 4-byte aligned
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int b = max(0, min(4, bytes - 4 * u));
      cp_async_zfill<4>(dst + 4 * u, b > 0 ? src + 4 * u : head, b);
    }
  } else {
    // (Only 16-bit scales get here: f32 heads are always 4-byte aligned.)
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint16_t v = 2 * u < bytes ? *reinterpret_cast<const uint16_t*>(src + 2 * u) : 0;
      asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(dst + 2 * u), "h"(v) : "memory");
    }
  }
}

// Starts the copies of kRow-byte rows of keys [k0, k0 + kKeys) of kOps
// operands of one width (src[i] to the i-th block of kKeys rows from `base`,
// in swizzled slots). Rows past N (only when !kFull) are zero-filled without
// being read.
template <bool kFull, int kKeys, int kRow, int kOps>
__device__ __forceinline__ void
issue_rows(uint32_t base, int k0, int N, int lane, const uint8_t* const (&src)[kOps]) {
  constexpr int kChunks = kRow / 16;
  using Swz = Swizzle<kChunks>;
  constexpr int kCopies = kKeys * kChunks / 32; // per lane and operand
  // Copy u of a lane is chunk lane + 32 u of the step, linear in global
  // memory: row r0 + u * kRowsPerCopy, chunk c. Full steps address it as
  // one base plus a compile-time offset (no per-copy 64-bit math).
  constexpr int kRowsPerCopy = 32 / kChunks;
  constexpr int kCopyBytes = 32 * 16; // one copy of the whole warp
  static_assert(32 % kChunks == 0, "a warp's copies must cover whole rows");
  const int r0 = lane / kChunks, c = lane % kChunks;
  const size_t lane_src = size_t(k0 + r0) * kRow + 16 * c;
#pragma unroll
  for (int u = 0; u < kCopies; ++u) {
    const int r = r0 + u * kRowsPerCopy;
    const uint32_t dst = base + 16 * Swz::slot(r, c);
    if constexpr (kFull) {
#pragma unroll
      for (int i = 0; i < kOps; ++i)
        cp_async_zfill<16>(dst + i * kKeys * kRow, src[i] + lane_src + kCopyBytes * u, 16);
    } else {
      // Rows past N read row N - 1's address but copy 0 bytes of it.
      const int key = min(k0 + r, N - 1);
      const int bytes = k0 + r < N ? 16 : 0;
      const size_t at = size_t(key) * kRow + 16 * c;
#pragma unroll
      for (int i = 0; i < kOps; ++i)
        cp_async_zfill<16>(dst + i * kKeys * kRow, src[i] + at, bytes);
    }
  }
}

// Starts the copies of the K and V codes of keys [k0, k0 + kKeys) into a
// stage: K rows, then V rows (in one pass when they are of one width).
template <bool kFull, typename S>
__device__ __forceinline__ void
issue_codes(uint8_t* stage, int k0, int N, int lane, const uint8_t* k, const uint8_t* v) {
  const uint32_t base = smem_addr(stage);
  if constexpr (S::kKRow == S::kVRow) {
    const uint8_t* const src[2] = {k, v};
    issue_rows<kFull, S::kKeys, S::kKRow, 2>(base, k0, N, lane, src);
  } else {
    const uint8_t* const ks[1] = {k};
    const uint8_t* const vs[1] = {v};
    issue_rows<kFull, S::kKeys, S::kKRow, 1>(base, k0, N, lane, ks);
    issue_rows<kFull, S::kKeys, S::kVRow, 1>(base + S::kKeys * S::kKRow, k0, N, lane, vs);
  }
}

// The kernel's per-step stages, always inlined: issue_step and decode_step
// were lambdas of decode_kernel_impl and take its values by const reference
// as the lambdas captured them, so the sm_90 SASS is identical to the
// single-function kernel. The query fragments and the block merge below
// moved later; see bench/results/gpu_stages_nvidia_h200.json for their
// effect on the SASS and on time.

// Ring issue: one step's codes (K and V rows of S::kKeys keys from kk, zero
// past N) and its four scale arrays into a ring stage, as one cp.async group.
// The lane's scale copies j start at scale_src[j] (offset scale_off[j] into
// their array, whose keys are key_bytes[j] apart: K's and V's differ when
// their group sizes do).
template <typename S, typename ST>
__device__ __forceinline__ void issue_step(
    const Views<ST>& views,
    const uint8_t* const (&scale_src)[S::kScaleCopies],
    const int (&scale_off)[S::kScaleCopies],
    const int (&key_bytes)[S::kScaleCopies],
    const int& N,
    const int& lane,
    uint8_t* stage,
    int kk) {
  const bool full = kk + S::kKeys <= N;
  if (full) {
    issue_codes<true, S>(stage, kk, N, lane, views.k, views.v);
  } else {
    issue_codes<false, S>(stage, kk, N, lane, views.k, views.v);
  }
  const uint32_t dst = smem_addr(stage + S::kCodeBytes);
  const int keys = min(N - kk, S::kKeys);
#pragma unroll
  for (int j = 0; j < S::kScaleCopies; ++j) {
    const int i = lane + 32 * j;
    if (S::kScaleChunks % 32 == 0 || i < S::kScaleChunks) {
      const int per_key = S::kSameGroups ? S::kKGroups * int(sizeof(ST)) : key_bytes[j];
      const size_t step = size_t(kk) * per_key;
      // Bytes of the array that exist for this step (keys past N: zeros).
      const int have = keys * per_key;
      const int bytes = full ? 16 : max(0, min(16, have - scale_off[j]));
      const int mis = int(reinterpret_cast<uintptr_t>(scale_src[j]) & 15);
      if (full && mis == 0) {
        cp_async_zfill<16>(dst + 16 * i, scale_src[j] + step, 16);
      } else {
        copy_scale_chunk<sizeof(ST)>(
            dst + 16 * i, scale_src[j] + step, scale_src[j] - scale_off[j], bytes, mis);
      }
    }
  }
  cp_async_commit();
}

// Step: one warp step of S::kKeys keys from a landed ring stage: the scores
// on tensor cores (fed K codes against the query fragments), the masks where
// `masked` (std::true_type: keys past N or causal), the online softmax update
// of (m, l) and the value products into acc, poff and vbias.
template <
    int KB,
    int VB,
    typename S,
    typename ST,
    bool kTwoTerms,
    typename QFrag,
    typename KTileRows,
    typename VTileRows,
    typename Masked>
__device__ __forceinline__ void decode_step(
    const QFrag& qfrag,
    const KTileRows& k_tile_rows,
    const VTileRows& v_tile_rows,
    const int& q,
    const int& t,
    const int& N,
    const int& limit0,
    const int& limit1,
    const SdpaArgs& a,
    const float (&inv)[2],
    const float (&off)[S::kKGroups][2],
    const float (&qs)[S::kKGroups][2],
    const uint32_t (&ones)[4],
    float (&m)[2],
    float (&l)[2],
    float (&vbias)[S::kVGroups][2],
    float (&acc)[S::kVTiles][4],
    float (&poff)[S::kVGroups][4],
    int k0,
    const uint8_t* stg,
    Masked masked) {
  constexpr int G = S::kKGroups;
  constexpr int VG = S::kVGroups;
  constexpr float kVOff = kVOffset<VB>;
  constexpr bool clean = !decltype(masked)::value;
  // The step's scales after the codes: [ks, kb][key][G], then [vs, vb][key][VG].
  const ST* sc = reinterpret_cast<const ST*>(stg + S::kCodeBytes);
  auto key_params = [&](int arr, int key, float* out) { // arr 0: scales, 1: biases
    load_row<G>(sc + (arr * S::kKeys + key) * G, out);
  };
  auto value_params = [&](int arr, int key, float* out) {
    load_row<VG>(sc + 2 * S::kKeys * G + (arr * S::kKeys + key) * VG, out);
  };

  // Scores of keys 16 mt + q (e = 0, 1) and 16 mt + q + 8 (e = 2, 3) for
  // rows 2t + (e & 1), in log2 units.
  float s[S::kKeyTiles][4];
#pragma unroll
  for (int mt = 0; mt < S::kKeyTiles; ++mt) {
    float sk[2][2 * G]; // K scales and biases of keys q, q + 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      key_params(0, 16 * mt + 8 * h + q, sk[h]);
      key_params(1, 16 * mt + 8 * h + q, sk[h] + G);
    }
    // kx[c][h]: word t of chunk c of key q + 8h.
    uint32_t kx[S::kKChunks][2];
#pragma unroll
    for (int c = 0; c < S::kKChunks; c += 2) {
      uint32_t r[4];
      ldsm_x4(r, k_tile_rows(stg, mt, c));
      kx[c][0] = r[0], kx[c][1] = r[1], kx[c + 1][0] = r[2], kx[c + 1][1] = r[3];
    }
    float d[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      d[g][0] = d[g][1] = d[g][2] = d[g][3] = 0.0f;
#pragma unroll
      for (int j = 0; j < S::kGroupKSteps; ++j) {
        const int J = g * S::kGroupKSteps + j, c = J / S::kChunkKSteps;
        uint32_t af[4];
        if constexpr (KB == 4) {
          const uint32_t x0 = kx[c][0] >> (8 * (J & 1));
          const uint32_t x1 = kx[c][1] >> (8 * (J & 1));
          af[0] = and_or(x0, 0x000F000Fu, kF16Magic);
          af[1] = and_or(x1, 0x000F000Fu, kF16Magic);
          af[2] = and_or(x0, 0x00F000F0u, kF16Magic);
          af[3] = and_or(x1, 0x00F000F0u, kF16Magic);
        } else {
          const uint32_t x0 = kx[c][0], x1 = kx[c][1];
          af[0] = __byte_perm(x0, kF16Magic, 0x7250);
          af[1] = __byte_perm(x1, kF16Magic, 0x7250);
          af[2] = __byte_perm(x0, kF16Magic, 0x7351);
          af[3] = __byte_perm(x1, kF16Magic, 0x7351);
        }
        const uint2 bq = qfrag(g, j);
        mma<__half>(d[g], af, bq.x, bq.y);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float* kk = sk[e >> 1];
      float v = 0.0f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        v = fmaf(kk[g], fmaf(d[g][e], inv[e & 1], off[g][e & 1]), v);
        v = fmaf(kk[G + g], qs[g][e & 1], v);
      }
      s[mt][e] = v;
    }
  }
  if constexpr (!clean) {
    // Each row's mask over the keys (bool: a left-padded batch's padding, a
    // ring's window; additive: multi-head latent attention's RoPE scores),
    // or null: rows past R and problems without one. Made here from the
    // kernel's parameters and block index, not kept live through the loop:
    // the clean steps' registers stay as they were.
    const uint8_t* mrow[2] = {nullptr, nullptr};
    const int item = a.mask_dtype == kF32 ? 4 : a.mask_dtype == kBool ? 1 : 2; // bytes
    if (a.mask_kind == kMaskArray) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = 2 * t + i;
        if (r < a.rows) {
          mrow[i] = static_cast<const uint8_t*>(a.mask) +
              (blockIdx.z * a.m_st[0] + row_head(blockIdx.y, r, a.rep) * a.m_st[1] +
               row_position(r, a.rep) * a.m_st[2]) *
                  item;
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < S::kKeyTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 16 * mt + q + 8 * (e >> 1);
        const uint8_t* row_mask = mrow[e & 1];
        bool visible = key < N && key <= ((e & 1) ? limit1 : limit0);
        if (visible && row_mask != nullptr) {
          // (Scores are in log2 units: an additive term is scaled to them.)
          const float mv = load_float(row_mask + key * a.m_st[3] * item, 0, a.mask_dtype);
          if (a.mask_dtype == kBool) {
            visible = mv != 0.0f;
          } else {
            s[mt][e] = fmaf(mv, kLog2e, s[mt][e]);
          }
        }
        s[mt][e] = visible ? s[mt][e] : -INFINITY;
      }
    }
  }

  // Online softmax (log2 domain), rows 2t + i. A row's running max moves
  // only when a step's max passes it by more than kMaxSlack: p stays below
  // 2^kMaxSlack (exact enough in f32 sums and bf16 P'), and the rescale of
  // O and l is skipped in almost every step instead of whenever a max grows.
  float tmax[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    tmax[i] = -INFINITY;
#pragma unroll
    for (int mt = 0; mt < S::kKeyTiles; ++mt) {
      tmax[i] = fmaxf(tmax[i], fmaxf(s[mt][i], s[mt][2 + i]));
    }
    tmax[i] = lanes_max<4, 16>(tmax[i]);
  }
  // (m = -inf: any finite score grows it.)
  const bool grow = tmax[0] > m[0] + kMaxSlack || tmax[1] > m[1] + kMaxSlack;
  if (__any_sync(0xffffffffu, grow)) {
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], tmax[i]);
      corr[i] = m_new == -INFINITY ? 1.0f : fast_exp2(m[i] - m_new);
      m[i] = m_new;
      l[i] *= corr[i];
    }
#pragma unroll
    for (int i = 0; i < S::kVTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[i][e] *= corr[e & 1];
    }
#pragma unroll
    for (int g = 0; g < VG; ++g) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        poff[g][e] *= corr[e & 1];
      vbias[g][0] *= corr[0];
      vbias[g][1] *= corr[1];
    }
  }
  const float ms[2] = {m[0] == -INFINITY ? 0.0f : m[0], m[1] == -INFINITY ? 0.0f : m[1]};
  float p[S::kKeyTiles][4];
#pragma unroll
  for (int mt = 0; mt < S::kKeyTiles; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[mt][e] = fast_exp2(s[mt][e] - ms[e & 1]);
      l[e & 1] += p[mt][e];
    }
  }

  // O^T += V_codes^T . P'^T per group, P' = p * V scale (0 where p is 0 in
  // steps with hidden keys, so their scales never reach the sums).
#pragma unroll
  for (int mt = 0; mt < S::kKeyTiles; ++mt) {
    // vx[c][h]: chunk c of keys 2t, 2t + 1 (h = 0) or 2t + 8, 2t + 9 (h = 1).
    uint32_t vx[S::kVChunks][2];
#pragma unroll
    for (int c = 0; c < S::kVChunks; c += 2) {
      uint32_t r[4];
      ldsm_x4_trans(r, v_tile_rows(stg + S::kKeys * S::kKRow, mt, c));
      vx[c][0] = r[0], vx[c][1] = r[1], vx[c + 1][0] = r[2], vx[c + 1][1] = r[3];
    }
    float sv[2][2 * VG]; // V scales and biases of keys q, q + 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      value_params(0, 16 * mt + 8 * h + q, sv[h]);
      value_params(1, 16 * mt + 8 * h + q, sv[h] + VG);
    }
#pragma unroll
    for (int g = 0; g < VG; ++g) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float* vv = sv[e >> 1];
        const float pe = p[mt][e];
        // Rounded products (no FMA contraction into the sums below), in
        // clean and masked steps alike: a key's terms are then the same
        // bits whichever kind of step reads it (compiled decode's masked
        // whole-buffer steps match eager's clean ones, see row_tiling.h).
        x[e] = __fmul_rn(pe, vv[g]);
        float vbt = __fmul_rn(pe, vv[VG + g]);
        if constexpr (!clean) {
          x[e] = pe != 0.0f ? x[e] : 0.0f;
          vbt = pe != 0.0f ? vbt : 0.0f;
        }
        vbias[g][e & 1] += vbt;
      }
      uint32_t bh[2];
      [[maybe_unused]] uint32_t bl[2] = {0u, 0u}; // the f16-query low term
#pragma unroll
      for (int h = 0; h < 2; ++h) { // keys q + 8h, rows 2t, 2t + 1
        const uint32_t hi = pack2<__nv_bfloat16>(x[2 * h], x[2 * h + 1]);
        bh[h] = transpose8x8(hi);
        if constexpr (kTwoTerms) {
          bl[h] = transpose8x8(bf16_rest(x[2 * h], x[2 * h + 1], hi));
        }
      }
      if constexpr (kVOff != 0.0f) {
        mma<__nv_bfloat16>(poff[g], ones, bh[0], bh[1]);
        if constexpr (kTwoTerms) {
          mma<__nv_bfloat16>(poff[g], ones, bl[0], bl[1]);
        }
      }
      // Chunks of group g; lane: codes of keys 2t (low half), 2t + 1 (high)
      // at bytes 2q, 2q + 1 of the chunk (and keys 2t + 8, 2t + 9).
#pragma unroll
      for (int cg = 0; cg < S::kVChunksPerGroup; ++cg) {
        const int c = g * S::kVChunksPerGroup + cg;
#pragma unroll
        for (int jj = 0; jj < S::kTilesPerChunk; ++jj) {
          uint32_t av[4];
#pragma unroll
          for (int h = 0; h < 2; ++h) { // h = 0: row q; 1: row q + 8 (the next dim)
            const int shift = (2 * jj + h) * VB;
            av[h] = v_code_pair<VB>(vx[c][0] >> shift);
            av[2 + h] = v_code_pair<VB>(vx[c][1] >> shift);
          }
          float (&o)[4] = acc[c * S::kTilesPerChunk + jj];
          mma<__nv_bfloat16>(o, av, bh[0], bh[1]);
          if constexpr (kTwoTerms) {
            mma<__nv_bfloat16>(o, av, bl[0], bl[1]);
          }
        }
      }
    }
  }
}

// Query fragments: the lane's query values (row q) as the B operand of the
// scores, scaled by 2^e per row into f16 range (the high-nibble slots of
// 4-bit codes take q / 16), into qf (and qsm for D > 128, from warp 0); and
// the per-row constants of its score columns in log2 softmax units.
// Arguments by reference, as the kernel's locals they were.
template <typename S, bool kTwoTerms>
__device__ __forceinline__ void load_query_fragments(
    const SdpaArgs& a,
    const int& b,
    const int& kvh,
    const int& q,
    const int& t,
    const int& lane,
    const int& warp,
    const int& R,
    uint2* qsm,
    uint32_t (&qf)[S::kKGroups][S::kGroupKSteps][2],
    float (&inv)[2],
    float (&off)[S::kKGroups][2],
    float (&qs)[S::kKGroups][2]) {
  constexpr int G = S::kKGroups;
  // The lane's query values (row q), read once: its row base is computed
  // once (no per-element divisions by rep), the dtype is the instance's.
  using QT = std::conditional_t<kTwoTerms, __half, __nv_bfloat16>;
  const bool qlive = q < R;
  const QT* qrow = static_cast<const QT*>(a.q) + b * a.q_st[0] +
      (kvh * a.rep + (qlive ? q % a.rep : 0)) * a.q_st[1] + (qlive ? q / a.rep : 0) * a.q_st[2];
  float qv[G][S::kGroupKSteps][4];
  float amax = 0.0f;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int j = 0; j < S::kGroupKSteps; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qv[g][j][e] = qlive ? to_f32(qrow[S::key_dim(t, g, j, e) * a.q_st[3]]) : 0.0f;
        amax = fmaxf(amax, fabsf(qv[g][j][e]));
      }
    }
  }
  amax = lanes_max<1, 2>(amax);
  int ex = 0;
  frexpf(amax, &ex);
  // (The exponent stays finite for bf16 rows below 2^-113.)
  const float up = amax > 0.0f && amax <= FLT_MAX ? ldexpf(1.0f, min(15 - ex, 126)) : 1.0f;
  float fed[G], qsum[G]; // per group: sum of the fed f16 values, sum of q
#pragma unroll
  for (int g = 0; g < G; ++g) {
    fed[g] = qsum[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < S::kGroupKSteps; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int e = 2 * h + i;
          const float x = qv[g][j][e];
          qsum[g] += x;
          v[i] = x * up * (S::high_nibble(e) ? 0.0625f : 1.0f);
        }
        const __half2 hv = __floats2half2_rn(v[0], v[1]);
        const float2 back = __half22float2(hv);
        fed[g] += back.x + back.y;
        qf[g][j][h] = h2_bits(hv);
      }
      if (S::kQInSmem && warp == 0) {
        qsm[(g * S::kGroupKSteps + j) * 32 + lane] = make_uint2(qf[g][j][0], qf[g][j][1]);
      }
    }
  }
  // Per-row constants of the lane's score columns (rows 2t, 2t + 1), all in
  // log2 softmax units: 2^-e, the fed codes' 1024 offset, and qsum (for the
  // biases).
  const float scale2 = a.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    fed[g] = lanes_sum<1, 2>(fed[g]);
    qsum[g] = lanes_sum<1, 2>(qsum[g]);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int src = 4 * (2 * t + i);
    const float down = 1.0f / __shfl_sync(0xffffffffu, up, src);
    inv[i] = down * scale2;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      off[g][i] = -1024.0f * __shfl_sync(0xffffffffu, fed[g], src) * inv[i];
      qs[g][i] = __shfl_sync(0xffffffffu, qsum[g], src) * scale2;
    }
  }
}

// Block merge: the four warps' states of rows 2t, 2t + 1 into one partial
// (output, max, sum) per block in a.part_o / a.part_ml, through the freed
// rings (`codes`) and the per-warp (max, sum) rows wm / wl.
template <int VB, int D, typename S>
__device__ __forceinline__ void merge_block(
    const SdpaArgs& a,
    const int& b,
    const int& kvh,
    const int& q,
    const int& t,
    const int& warp,
    const int& R,
    float (&m)[2],
    float (&l)[2],
    float (&vbias)[S::kVGroups][2],
    float (&acc)[S::kVTiles][4],
    float (&poff)[S::kVGroups][4],
    uint8_t* codes,
    float* wm,
    float* wl) {
  constexpr int G = S::kVGroups;
  constexpr float kVOff = kVOffset<VB>;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] = lanes_sum<4, 16>(l[i]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      vbias[g][i] = lanes_sum<4, 16>(vbias[g][i]);
    }
  }
  if (q == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wm[warp * S::kMaxRows + 2 * t + i] = m[i];
      wl[warp * S::kMaxRows + 2 * t + i] = l[i];
    }
  }
  cp_async_wait_all();
  __syncthreads(); // every warp is done with its ring: it now holds the outputs
  // Each warp's weight for rows 2t, 2t + 1 (its output columns).
  float wgt[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = 2 * t + i;
    float mb = -INFINITY;
    if (r < R) {
      for (int w = 0; w < kWarps; ++w)
        mb = fmaxf(mb, wm[w * S::kMaxRows + r]);
    }
    wgt[i] = r < R && m[i] != -INFINITY ? exp2f(m[i] - mb) : 0.0f;
  }
  // Every (row, dim) of a warp's slice is written by exactly one lane.
  float* wout = reinterpret_cast<float*>(codes) + warp * S::kMaxRows * D;
#pragma unroll
  for (int c = 0; c < S::kVChunks; ++c) {
    const int g = c / S::kVChunksPerGroup;
#pragma unroll
    for (int jj = 0; jj < S::kTilesPerChunk; ++jj) {
      const int tile = c * S::kTilesPerChunk + jj;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e & 1, r = 2 * t + i;
        const int d = c * S::kVChunkDims + (S::kVChunkDims / 8) * q + 2 * jj + (e >> 1);
        const float o = acc[tile][e] - kVOff * poff[g][i] + vbias[g][i];
        wout[r * D + d] = wgt[i] > 0.0f ? wgt[i] * o : 0.0f;
      }
    }
  }
  __syncthreads();
  const int64_t blk = (int64_t(b) * a.Hkv + kvh) * a.splits + blockIdx.x;
  const float* outs = reinterpret_cast<const float*>(codes);
  for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      o += outs[w * S::kMaxRows * D + i];
    a.part_o[blk * R * D + i] = o;
  }
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    float mb = -INFINITY;
    for (int w = 0; w < kWarps; ++w)
      mb = fmaxf(mb, wm[w * S::kMaxRows + r]);
    float lb = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = wm[w * S::kMaxRows + r];
      lb += mw == -INFINITY ? 0.0f : exp2f(mw - mb) * wl[w * S::kMaxRows + r];
    }
    a.part_ml[(blk * R + r) * 2] = mb == -INFINITY ? -INFINITY : mb * kLn2;
    a.part_ml[(blk * R + r) * 2 + 1] = lb;
  }
}

// Eight 16-bit values (f16 or bf16) of a window row from element `at` of
// `base`, `stride` apart, as floats: one 16-byte load where the host allows
// it (SdpaArgs::recent_vec), else eight.
__device__ __forceinline__ void
load8(const void* base, int64_t at, int64_t stride, int vec, int dtype, float (&out)[8]) {
  if (vec) {
    const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + at);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (dtype == kBF16) {
        out[2 * i] = __uint_as_float(ws[i] << 16);
        out[2 * i + 1] = __uint_as_float(ws[i] & 0xFFFF0000u);
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&ws[i]));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      out[e] = load_float(base, at + e * stride, dtype);
  }
}

// Shared floats a recent block uses: the rows' scaled queries, their
// scores (then weights) over the block's keys, and each row's max and sum.
template <int D, int kMaxRows>
constexpr int kRecentSmemFloats = kMaxRows * (D + kRecentKeys + 2);

// A recent block: kRecentKeys rows of the step's exact window (SdpaArgs::
// recent), attended in float32 by the last blocks of a (batch, KV head),
// each writing one partial as a key split does, so the split merge folds
// the window in with the quantized keys: no second launch, no log-sum-exp
// output, no second merge. A thread per (key, half of the rows) computes
// scores from the queries in shared memory; a warp per row takes the max
// and the weights; a thread per value dim (and, at head dim 64, half of the
// rows) sums the weighted rows, loading a batch of keys' values (32 values
// per thread) before using them.
template <int D, int kMaxRows>
__device__ void attend_recent(const SdpaArgs& a, int b, int kvh, int kv, float* sm) {
  constexpr int kThreads = kWarps * 32;
  constexpr int K = kRecentKeys;
  static_assert(kThreads % K == 0 && kMaxRows % (kThreads / K) == 0, "recent block shape");
  static_assert(K == 64, "each lane of a row's warp takes two keys");
  const int R = a.rows, T = a.recent;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j0 = (blockIdx.x - (a.splits - a.recent_splits)) * K;
  float* qs = sm; // [kMaxRows][D]
  float* ps = qs + kMaxRows * D; // [kMaxRows][K]
  float* row_m = ps + kMaxRows * K; // natural-log units
  float* row_l = row_m + kMaxRows;
  for (int i = threadIdx.x; i < kMaxRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float v = 0.0f;
    if (r < R) {
      const int h = row_head(kvh, r, a.rep), l = row_position(r, a.rep);
      v = a.scale *
          load_float(a.q, b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2] + d * a.q_st[3], a.q_dtype);
    }
    qs[i] = v;
  }
  __syncthreads();
  {
    constexpr int kRows = kMaxRows * K / kThreads; // rows of a thread's key
    const int jj = threadIdx.x % K, r0 = (threadIdx.x / K) * kRows;
    const int j = j0 + jj;
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      s[r] = 0.0f;
    if (j < T) {
      const int64_t k0 = b * a.rk_st[0] + kv * a.rk_st[1] + int64_t(j) * a.rk_st[2];
#pragma unroll 4
      for (int d = 0; d < D; d += 8) {
        float kx[8];
        load8(a.rk, k0 + d * a.rk_st[3], a.rk_st[3], a.recent_vec, a.q_dtype, kx);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            s[r] = fmaf(qs[(r0 + r) * D + d + e], kx[e], s[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = r0 + r;
      bool visible = j < T && row < R;
      if (visible && a.recent_causal) {
        visible = j <= row_position(row, a.rep) + T - a.L;
      }
      ps[row * K + jj] = visible ? s[r] : -INFINITY;
    }
  }
  __syncthreads();
  for (int r = warp; r < kMaxRows; r += kWarps) {
    const float x0 = ps[r * K + lane], x1 = ps[r * K + lane + 32];
    const float m = warp_max(fmaxf(x0, x1));
    // (A row that sees none of these keys keeps weights 0 and max -inf: the
    // merge gives its partial no weight.)
    const float p0 = x0 == -INFINITY ? 0.0f : expf(x0 - m);
    const float p1 = x1 == -INFINITY ? 0.0f : expf(x1 - m);
    ps[r * K + lane] = p0;
    ps[r * K + lane + 32] = p1;
    const float l = warp_sum(p0 + p1);
    if (lane == 0) {
      row_m[r] = m;
      row_l[r] = l;
    }
  }
  __syncthreads();
  constexpr int kDimThreads = D < kThreads ? D : kThreads;
  constexpr int kGroups = kThreads / kDimThreads; // row groups
  constexpr int kOutRows = kMaxRows / kGroups;
  constexpr int kDims = D / kDimThreads;
  constexpr int kBatch = 32 / kDims; // keys whose values are loaded before use
  static_assert(kThreads % kDimThreads == 0 && D % kDimThreads == 0, "recent output shape");
  const int dt = threadIdx.x % kDimThreads, r0 = (threadIdx.x / kDimThreads) * kOutRows;
  float acc[kOutRows][kDims];
#pragma unroll
  for (int r = 0; r < kOutRows; ++r) {
#pragma unroll
    for (int c = 0; c < kDims; ++c)
      acc[r][c] = 0.0f;
  }
  const int keys = min(K, T - j0);
  const int64_t v0 = b * a.rv_st[0] + kv * a.rv_st[1];
  for (int jb = 0; jb < keys; jb += kBatch) {
    float vv[kBatch][kDims];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int c = 0; c < kDims; ++c) {
        const int64_t at =
            v0 + int64_t(j0 + jb + u) * a.rv_st[2] + int64_t(dt + c * kDimThreads) * a.rv_st[3];
        vv[u][c] = jb + u < keys ? load_float(a.rv, at, a.q_dtype) : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int r = 0; r < kOutRows; ++r) {
        const float p = ps[(r0 + r) * K + jb + u]; // 0 past the keys
#pragma unroll
        for (int c = 0; c < kDims; ++c)
          acc[r][c] = fmaf(p, vv[u][c], acc[r][c]);
      }
    }
  }
  const int64_t blk = (int64_t(b) * a.Hkv + kvh) * a.splits + blockIdx.x;
#pragma unroll
  for (int r = 0; r < kOutRows; ++r) {
    if (r0 + r < R) {
#pragma unroll
      for (int c = 0; c < kDims; ++c)
        a.part_o[(blk * R + r0 + r) * D + dt + c * kDimThreads] = acc[r][c];
    }
  }
  if (threadIdx.x < R) {
    a.part_ml[(blk * R + threadIdx.x) * 2] = row_m[threadIdx.x];
    a.part_ml[(blk * R + threadIdx.x) * 2 + 1] = row_l[threadIdx.x];
  }
}

template <int KB, int VB, int D, int KGS, int VGS, typename ST, bool kTwoTerms>
__global__ void __launch_bounds__(kWarps * 32, Shape<KB, VB, D, KGS, VGS, ST>::kMinBlocks)
    decode_kernel_impl(SdpaArgs a) {
  using S = Shape<KB, VB, D, KGS, VGS, ST>;
  constexpr int G = S::kKGroups;
  constexpr int VG = S::kVGroups;
  extern __shared__ float4 smem4[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = lane >> 2, t = lane & 3;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int R = a.rows;
  // (kvh is a query-head group of KV head kv when the plan splits one: a
  // multiply-high by the host's magic instead of a division, which took
  // registers from the step loop.)
  const int kv = a.head_group_magic ? int(__umulhi(unsigned(kvh), a.head_group_magic)) : kvh;
  if (a.recent_splits > 0 && int(blockIdx.x) >= a.splits - a.recent_splits) {
    attend_recent<D, S::kMaxRows>(a, b, kvh, kv, reinterpret_cast<float*>(smem4));
    if (a.counters && last_block_of_head(a.counters + b * a.Hkv + kvh, a.splits)) {
      merge_head_splits<kWarps * 32>(
          a, b, kvh, reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem4) + S::kQSmemBytes));
    }
    return;
  }

  // Shared memory: query fragments (D > 128), per-warp rings of step stages
  // (after the loop: each warp's weighted output [warps][rows][D]), then
  // each warp's (max, sum) per row.
  uint2* qsm = reinterpret_cast<uint2*>(smem4); // [k-steps][lanes] with kQInSmem
  uint8_t* codes = reinterpret_cast<uint8_t*>(smem4) + S::kQSmemBytes; // [warps][stages][step]
  float* wm =
      reinterpret_cast<float*>(codes + kWarps * S::kStages * S::kStepBytes); // [warps][rows]
  float* wl = wm + kWarps * S::kMaxRows;

  // The K/V views and the ring prologue come first: the first steps' copies
  // are in flight while the query loads below wait on memory, so a block's
  // start costs one memory latency, not two.
  Views<ST> views;
  views.k = reinterpret_cast<const uint8_t*>(a.kw + b * a.kw_st[0] + kv * a.kw_st[1]);
  views.v = reinterpret_cast<const uint8_t*>(a.vw + b * a.vw_st[0] + kv * a.vw_st[1]);
  views.ks = static_cast<const ST*>(a.ks) + b * a.ks_st[0] + kv * a.ks_st[1];
  views.kb = static_cast<const ST*>(a.kb) + b * a.kb_st[0] + kv * a.kb_st[1];
  views.vs = static_cast<const ST*>(a.vs) + b * a.vs_st[0] + kv * a.vs_st[1];
  views.vb = static_cast<const ST*>(a.vb) + b * a.vb_st[0] + kv * a.vb_st[1];
  const int N = a.N;
  // Keys up to `clean_end` are visible to every row: no per-score masking
  // (none with a bool mask array: every step reads it).
  const int clean_end = a.mask_kind == kMaskArray ? 0
      : a.mask_kind == kMaskCausal                ? N - a.L + 1
                                                  : N;

  // Each warp walks its steps (every kWarps-th of the split) through a ring
  // of kStages stages (codes and scales), kStages - 1 steps ahead.
  const int split_begin = blockIdx.x * a.split_keys;
  const int split_end = min(N, split_begin + a.split_keys);
  constexpr int kStride = kWarps * S::kKeys;
  uint8_t* ring = codes + warp * S::kStages * S::kStepBytes;
  // The lane's scale copies j: chunk lane + 32 j of a step's four scale
  // arrays (16-byte chunk c of array ks, kb, vs or vb: K's arrays, then V's);
  // the step of keys k0 starts k0 * groups elements into each array.
  constexpr int kKChunks = S::kKScaleBytes / 16, kVChunks = S::kVScaleBytes / 16;
  const uint8_t* scale_src[S::kScaleCopies];
  int scale_off[S::kScaleCopies], key_bytes[S::kScaleCopies];
#pragma unroll
  for (int j = 0; j < S::kScaleCopies; ++j) {
    const int i = min(lane + 32 * j, S::kScaleChunks - 1);
    const bool k_side = S::kSameGroups || i < 2 * kKChunks;
    const int per = k_side ? kKChunks : kVChunks;
    const int rel = k_side ? i : i - 2 * kKChunks;
    const int arr = (k_side ? 0 : 2) + rel / per;
    const ST* base = arr == 0 ? views.ks : arr == 1 ? views.kb : arr == 2 ? views.vs : views.vb;
    scale_off[j] = 16 * (rel % per);
    scale_src[j] = reinterpret_cast<const uint8_t*>(base) + scale_off[j];
    key_bytes[j] = (arr < 2 ? G : VG) * int(sizeof(ST));
  }
  int k0 = split_begin + warp * S::kKeys;
#pragma unroll
  for (int i = 0; i < S::kStages - 1; ++i) {
    const int kk = k0 + i * kStride;
    if (kk < split_end) {
      issue_step<S>(views, scale_src, scale_off, key_bytes, N, lane, ring + i * S::kStepBytes, kk);
    } else {
      cp_async_commit();
    }
  }

  uint32_t qf[G][S::kGroupKSteps][2];
  float inv[2], off[G][2], qs[G][2];
  load_query_fragments<S, kTwoTerms>(a, b, kvh, q, t, lane, warp, R, qsm, qf, inv, off, qs);
  auto qfrag = [&](int g, int j) {
    if constexpr (S::kQInSmem) {
      return qsm[(g * S::kGroupKSteps + j) * 32 + lane];
    } else {
      return make_uint2(qf[g][j][0], qf[g][j][1]);
    }
  };
  __syncthreads();

  // Running state of the lane's rows 2t, 2t + 1: max (log2 units, the same
  // in all lanes of a t), this lane's share of the sum of p, sum p * V bias
  // per group, O^T tiles (dims x rows) and, for 4-bit codes, the ones . P'
  // sums whose 128 multiple is the codes' offset.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float vbias[VG][2];
  float acc[S::kVTiles][4];
  float poff[VG][4];
#pragma unroll
  for (int g = 0; g < VG; ++g) {
    vbias[g][0] = vbias[g][1] = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      poff[g][e] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < S::kVTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[i][e] = 0.0f;
  }
  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};

  // Each row's visible-key limit (causal) for masked steps.
  const int limit0 = a.mask_kind == kMaskCausal ? N - a.L + row_position(2 * t, a.rep) : N - 1;
  const int limit1 = a.mask_kind == kMaskCausal ? N - a.L + row_position(2 * t + 1, a.rep) : N - 1;

  // Fragments of one 16-key tile from a stage: lane i addresses row i % 8 of
  // matrix i / 8 = (keys 8 (i / 8 % 2) + .., chunk c + i / 16).
  // The swizzle repeats every 16 rows, so a lane's byte offset depends only
  // on the chunk pair: computed once, tile mt adds a constant. K and V rows
  // of different widths have their own swizzles.
  const int mi = lane >> 3;
  uint32_t ld_off[S::kKChunks / 2];
#pragma unroll
  for (int cp = 0; cp < S::kKChunks / 2; ++cp) {
    ld_off[cp] = 16 * S::KSwizzle::slot(8 * (mi & 1) + (lane & 7), 2 * cp + (mi >> 1));
  }
  uint32_t v_ld_off[S::kVChunks / 2];
#pragma unroll
  for (int cp = 0; cp < S::kVChunks / 2; ++cp) {
    v_ld_off[cp] = S::kKRow == S::kVRow
        ? ld_off[cp]
        : 16 * S::VSwizzle::slot(8 * (mi & 1) + (lane & 7), 2 * cp + (mi >> 1));
  }
  auto k_tile_rows = [&](const uint8_t* base, int mt, int c) {
    return base + ld_off[c / 2] + mt * 16 * S::kKRow;
  };
  auto v_tile_rows = [&](const uint8_t* base, int mt, int c) {
    return base + v_ld_off[c / 2] + mt * 16 * S::kVRow;
  };
  // One warp step; `masked` (std::true_type) for steps with keys hidden from
  // some row (past N or causal): only those pay for the per-score masks.
  auto step = [&](int k0, const uint8_t* stage, auto masked) {
    decode_step<KB, VB, S, ST, kTwoTerms>(
        qfrag,
        k_tile_rows,
        v_tile_rows,
        q,
        t,
        N,
        limit0,
        limit1,
        a,
        inv,
        off,
        qs,
        ones,
        m,
        l,
        vbias,
        acc,
        poff,
        k0,
        stage,
        masked);
  };
  int cur_stage = 0;
  for (; k0 < split_end; k0 += kStride) {
    const int refill = cur_stage == 0 ? S::kStages - 1 : cur_stage - 1;
    const int kk = k0 + (S::kStages - 1) * kStride;
    if (kk < split_end) {
      issue_step<S>(
          views, scale_src, scale_off, key_bytes, N, lane, ring + refill * S::kStepBytes, kk);
    } else {
      cp_async_commit();
    }
    cp_async_wait<S::kStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + cur_stage * S::kStepBytes;
    if (k0 + S::kKeys <= clean_end) {
      step(k0, stage, std::false_type{});
    } else {
      step(k0, stage, std::true_type{});
    }
    __syncwarp(); // every lane is done with this stage before it is refilled
    cur_stage = cur_stage == S::kStages - 1 ? 0 : cur_stage + 1;
  }

  merge_block<VB, D, S>(a, b, kvh, q, t, warp, R, m, l, vbias, acc, poff, codes, wm, wl);
  // The ring is free again: the merging block's weights go there.
  if (a.counters && last_block_of_head(a.counters + b * a.Hkv + kvh, a.splits)) {
    merge_head_splits<kWarps * 32>(a, b, kvh, reinterpret_cast<float*>(codes));
  }
}

template <typename S>
int smem_of() {
  static_assert(
      S::kStages * S::kStepBytes >= S::kMaxRows * S::kVTiles * 16 * 4,
      "a warp's ring must hold its outputs [rows][D] in floats");
  static_assert(
      kRecentSmemFloats<S::kVTiles * 16, S::kMaxRows> * 4 <=
          S::kQSmemBytes + kWarps * S::kStages * S::kStepBytes,
      "a recent block's queries and scores must fit the kernel's shared memory");
  return S::kQSmemBytes + kWarps * S::kStages * S::kStepBytes + 2 * kWarps * S::kMaxRows * 4;
}

template <int KB, int VB, int D, int KGS, int VGS, typename ST>
DecodeKernel instance_for(int q_dtype) {
  using S = Shape<KB, VB, D, KGS, VGS, ST>;
  DecodeKernel k{
      nullptr, smem_of<S>(), S::kMaxRows, S::kKeys * kWarps, kWarps * S::kStages * S::kStepBytes};
  k.fn = q_dtype == kBF16 ? handle<decode_kernel_impl<KB, VB, D, KGS, VGS, ST, false>>()
                          : handle<decode_kernel_impl<KB, VB, D, KGS, VGS, ST, true>>();
  return k;
}

template <int KB, int VB, int D, int KGS, int VGS>
DecodeKernel instance(int scale_dtype, int q_dtype) {
  switch (scale_dtype) {
    case kF16:
      return instance_for<KB, VB, D, KGS, VGS, __half>(q_dtype);
    case kBF16:
      return instance_for<KB, VB, D, KGS, VGS, __nv_bfloat16>(q_dtype);
    default:
      return instance_for<KB, VB, D, KGS, VGS, float>(q_dtype);
  }
}

// The instance of one group size (32 up to min(128, D)) for K and V alike
// at head dim D.
template <int BITS, int D>
DecodeKernel instance_of_group(int gs, int scale_dtype, int q_dtype) {
  switch (gs) {
    case 32:
      return instance<BITS, BITS, D, 32, 32>(scale_dtype, q_dtype);
    case 64:
      return instance<BITS, BITS, D, 64, 64>(scale_dtype, q_dtype);
    case 128:
      if constexpr (D >= 128) {
        return instance<BITS, BITS, D, 128, 128>(scale_dtype, q_dtype);
      }
  }
  return {};
}

// The instance of BITS-bit codes for (D, gs) among head dims Ds, or none.
template <int BITS, int... Ds>
DecodeKernel instance_of(int D, int gs, int scale_dtype, int q_dtype) {
  DecodeKernel k{};
  ((D == Ds ? (void)(k = instance_of_group<BITS, Ds>(gs, scale_dtype, q_dtype)) : void()), ...);
  return k;
}

// Mixed widths (KB-bit keys, VB-bit values) at head dim D: K groups 32 up
// to min(128, D), V groups the keys' or 32 (finer values cost little).
template <int KB, int VB, int D>
DecodeKernel pair_instance_of_groups(int kgs, int vgs, int scale_dtype, int q_dtype) {
  if (vgs != kgs && vgs != 32) {
    return {};
  }
  const bool fine = vgs == 32;
  switch (kgs) {
    case 32:
      return instance<KB, VB, D, 32, 32>(scale_dtype, q_dtype);
    case 64:
      return fine ? instance<KB, VB, D, 64, 32>(scale_dtype, q_dtype)
                  : instance<KB, VB, D, 64, 64>(scale_dtype, q_dtype);
    case 128:
      if constexpr (D >= 128) {
        return fine ? instance<KB, VB, D, 128, 32>(scale_dtype, q_dtype)
                    : instance<KB, VB, D, 128, 128>(scale_dtype, q_dtype);
      }
  }
  return {};
}

template <int KB, int VB, int... Ds>
DecodeKernel pair_instance_of(int D, int kgs, int vgs, int scale_dtype, int q_dtype) {
  DecodeKernel k{};
  ((D == Ds ? (void)(k = pair_instance_of_groups<KB, VB, Ds>(kgs, vgs, scale_dtype, q_dtype))
            : void()),
   ...);
  return k;
}

} // namespace

DecodeKernel decode_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype);
DecodeKernel decode_kernel_8bit(int D, int gs, int scale_dtype, int q_dtype);
DecodeKernel
decode_kernel_k8v4(int D, int k_group_size, int v_group_size, int scale_dtype, int q_dtype);

} // namespace mlxq::cuda
