// Arguments of mlxq's CUDA kernels, shared by the .cu kernels and the .cpp
// launch glue (which cannot include each other's headers: nvcc cannot parse
// MLX's, and MLX's launch API takes driver CUfunction handles). Each kernel
// takes one of these structs by value.
#pragma once

#include <cstdint>

#include "sdpa_codes.h"

namespace mlxq::cuda {

// Element types (DtypeCode: kF32, kF16, kBF16, kBool) and mask codes
// (MaskCode: kMaskNone, kMaskCausal, kMaskArray) are mlxq's one set, in
// sdpa_codes.h.
using DType = DtypeCode;

// Keys per tile and the most query rows (query heads x positions of one KV
// head) one block attends at once.
constexpr int kTileKeys = 32;
constexpr int kMaxTileRows = 16;
constexpr int kBlockThreads = 128;

struct SdpaArgs {
  const void* q;
  const uint32_t* kw;
  const void* ks;
  const void* kb;
  const uint32_t* vw;
  const void* vs;
  const void* vb;
  const void* mask;
  const float* sinks; // [Hq] or null
  void* out; // [B, Hq, L, Dv], contiguous
  // [B, Hq, L] or null: each row's log-sum-exp (quantized_sdpa with return_lse),
  // written by the split merge; the kernels then always write partials.
  float* lse;
  float* part_o; // splits > 1: [B * Hkv * row_tiles * splits, row_tile, Dv]
  float* part_ml; // splits > 1: [..., row_tile, 2] (max, sum)
  // Decode kernel only: per-(batch, KV head) tickets, zero at launch; the
  // last block of each merges the splits itself. Null: merge_kernel does.
  unsigned* counters;
  // Strides in elements of the 4-D inputs (mask: broadcast to [B, Hq, L, N]).
  int64_t q_st[4], kw_st[4], ks_st[4], kb_st[4], vw_st[4], vs_st[4], vb_st[4], m_st[4];
  int B, Hq, Hkv, L, N, Dk, Dv, rep;
  int k_group_size, k_bits, v_group_size, v_bits; // K's and V's quantization
  int q_dtype, scale_dtype, mask_dtype;
  int mask_kind; // MaskCode
  float scale;
  int rows; // rep * L rows per (batch, KV head)
  // Decode kernel only, where the plan attends a KV head's query heads in
  // groups (plan.h's head_groups; the launch binds Hkv KV heads of rep rows
  // each, grouped()): K/V are read at KV head blockIdx.y / head_groups,
  // computed as __umulhi(blockIdx.y, head_group_magic). 0: no groups.
  unsigned head_group_magic;
  int row_tile; // rows per block (<= kMaxTileRows)
  int row_tiles;
  int splits;
  int split_keys; // keys per split, a multiple of kTileKeys
  int vec_loads; // 1: K/V rows and bases allow 16-byte loads
  // Dense tiled kernel only: K and V dequantized, [B, Hkv, N, D] contiguous
  // in the query's dtype.
  const void* kd;
  const void* vd;
  // Decode kernel only: an exact window of `recent` rows beside the
  // quantized keys, [B, Hkv, recent, D] keys and values in the query's
  // dtype (strided), attended by the last recent_splits blocks of each
  // (batch, KV head), kRecentKeys rows each; 0: none. With recent_causal,
  // query position l sees window row j <= l + recent - L.
  const void* rk;
  const void* rv;
  int64_t rk_st[4], rv_st[4];
  int recent, recent_splits, recent_causal;
  int recent_vec; // 1: window rows and bases allow 16-byte loads
};

// Window rows per recent block of the decode kernel.
constexpr int kRecentKeys = 64;

// merge_kernel: one block of kMergeThreads per output row and 32 columns.
constexpr int kMergeThreads = 256;

struct RingArgs {
  const void* src; // update [B, H, T, D] (strided)
  void* dst; // buffer [B, H, S, D] (row-contiguous)
  const int32_t* pos;
  int64_t src_st[4];
  int B, H, T, S, D;
  int itemsize;
};

struct CopyArgs {
  const void* src; // [B, H, S, D] (strided)
  void* dst; // row-contiguous
  int64_t src_st[4];
  int B, H, S, D;
  int itemsize;
};

struct QuantRingArgs {
  const void* src; // update [B, H, T, D] (strided), dtype = scales dtype
  void* dst; // the part written: packed uint32 [B, H, S, W] or scales/biases [B, H, S, G]
  const int32_t* pos;
  int64_t src_st[4];
  int B, H, T, S, D, W, G, gs, bits, dtype;
  int part; // 0 codes, 1 scales, 2 biases (QuantizedRingUpdate::Part)
};

// One side (K or V) of a QuantizedKVUpdate.
struct QuantKVSide {
  const void* src; // update [B, H, T, D] (strided)
  int64_t src_st[4];
  uint32_t* codes; // [B, H, S, W]
  void* scales; // [B, H, S, G], update dtype
  void* biases;
  int D, W, G;
  // A recent window's ring [B, H, R, D] (row-contiguous) that takes the
  // rows `recent_src` [B, H, T, D] (strided) at rows (pos + t) mod R; null:
  // none.
  void* recent;
  const void* recent_src;
  int64_t recent_src_st[4];
  int R, itemsize;
};

struct QuantKVArgs {
  QuantKVSide side[2]; // K, V
  const int32_t* pos; // null: use pos_value
  int pos_value;
  int B, H, T, S, dtype;
  // The rings' own write position (RecentWrite::pos): when recent_own_pos,
  // recent_pos (null: recent_pos_value); else the buffers'.
  int recent_own_pos;
  const int32_t* recent_pos;
  int recent_pos_value;
};

// DequantizeInto: codes [B, H, N, W], scales and biases [B, H, N, G]
// (strided) into a row-contiguous [B, H, N, D] output.
struct DequantArgs {
  const uint32_t* w;
  const void* s;
  const void* z;
  void* out;
  int64_t w_st[4], s_st[4], z_st[4];
  int64_t chunks; // 8-code chunks: B * H * N * D / 8
  int H, N, D, gs, s_dtype;
};

struct FillArgs {
  void* dst;
  int64_t n_words; // 4-byte words
  uint32_t value;
};

// The GEMM family (sdpa/gemm.cu, cuda/gemm_sdpa.cpp): cuBLAS GEMMs over
// blocks of keys of a dense K/V copy, folded by an online softmax. Its rows
// are head-major within a (batch, KV head): row j * L + l is query head
// kvh * rep + j at position l, so that a contiguous [B, Hq, L, D] query is
// read in place.
constexpr int kGemmThreads = 256;
constexpr int kGemmMaxBlockKeys = 4096; // kGemmThreads * 4 floats * 4 passes

// Copies a strided query into [B * Hkv, rep * L, D] (the GEMM's row order).
struct GemmGatherArgs {
  const void* q;
  void* dst;
  int64_t q_st[4];
  int Hq, L, D;
  int64_t total; // B * Hq * L * D
  int vec; // 1: rows and bases allow 16-byte copies
};

// One block of keys: scores s (f32, [G, rows, ld], already scaled to base 2)
// become weights p written over them in the query's dtype (row stride 2 * ld
// of those), and the running output o ([G, rows, Dv] f32), row max m and row
// sum l (base 2, [G * rows]) absorb the block.
struct GemmFoldArgs {
  float* s;
  float* o;
  float* m;
  float* l;
  int ld, keys, n0, first, causal;
  int rows, L, N, Dv;
};

// o / l (with the sink in the denominator) into out [B, Hq, L, Dv].
struct GemmFinishArgs {
  const float* o;
  const float* m;
  const float* l;
  const float* sinks; // [Hq] or null
  void* out;
  float* lse; // [B, Hq, L] each row's log-sum-exp, or null
  int Hq, Hkv, L, Dv, rep, rows, out_dtype;
};

// RecentAttention (recent_attention.cu): one block per query row.
constexpr int kWindowWarps = 16;
struct WindowArgs {
  const void* q; // [B, Hq, L, Dk] (strided), dtype
  const void* k; // [B, Hkv, T, Dk]
  const void* v; // [B, Hkv, T, Dv]
  const void* out_q; // [B, Hq, L, Dv]
  const float* lse_q; // [B, Hq, L]
  void* out; // [B, Hq, L, Dv], contiguous
  int64_t q_st[4], k_st[4], v_st[4], o_st[4], l_st[3];
  int Hq, L, T, Dk, Dv, rep, dtype;
  int causal; // query l sees rows j <= l + T - L
  float scale;
};

// Driver handles of the kernels (cudaGetFuncBySymbol in the .cu files).
void* window_kernel();
void* generic_kernel(int k_bits, int v_bits);
void* merge_kernel();
void* ring_kernel();
void* copy_kernel();
void* quant_ring_kernel(int bits, int group_size);
void* quant_kv_kernel(int bits, int group_size);
// Both sides of a cache write of two quantizations in one launch (grid y:
// the side), or nullptr where there is no such instance (8-bit keys with
// 4-bit values of one group size have one).
void* quant_kv_pair_kernel(int k_bits, int k_group_size, int v_bits, int v_group_size);
void* fill_kernel();
void* dequantize_kernel(int bits, int out_dtype);
void* gemm_gather_kernel();
void* gemm_fold_kernel(int q_dtype);
void* gemm_finish_kernel();

// Dynamic shared memory of the sdpa kernel for the given head dims.
int generic_smem_bytes(int Dk, int Dv, int k_bits, int v_bits);

// The tensor-core decode kernel (sdpa/decode.cuh) for one (K bits, V bits,
// head dim, K group size, V group size, scales dtype, query dtype), or
// fn == nullptr where it has no instance (K and V of one quantization, or
// 8-bit keys with 4-bit values). A block is
// kDecodeWarps warps; splits are whole multiples of step_keys keys; it attends
// at most max_rows query rows per KV head and writes one partial per block.
constexpr int kDecodeWarps = 4;
struct DecodeKernel {
  void* fn = nullptr;
  int smem = 0;
  int max_rows = 0;
  int step_keys = 0;
  int merge_smem = 0; // shared bytes the fused split merge may use
};
DecodeKernel decode_kernel(
    int D,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    int scale_dtype,
    int q_dtype);

// The tensor-core tiled kernel (sdpa/tiled.cuh) for f16/bf16
// queries and Dk = Dv = D, or fn == nullptr where it has no instance. A
// block is `threads / 32` warps of 16 query rows (row tiles of at most
// `rows`) and walks its keys in tiles of `keys`; `warps` and `keys` ask for
// a block shape (those without an instance give the default, 4 x 32).
struct TiledKernel {
  void* fn = nullptr;
  int smem = 0;
  int threads = 0;
  int rows = 0;
  int keys = 0;
  bool dense = false; // reads SdpaArgs::kd / vd, a dense copy of K and V
};
TiledKernel tiled_kernel(int q_dtype, int D, int group_size, int warps, int keys);
// The tiled kernel over a dense copy of K and V in the query's dtype (head
// dims 256 and 512), if any.
TiledKernel tiled_dense_kernel(int q_dtype, int D);

} // namespace mlxq::cuda
