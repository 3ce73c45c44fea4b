// Argument blocks of mlxq's Metal kernels, shared word for word by the
// kernels (metal/*.metal), the host code (csrc/metal/*.cpp) and the grid
// arithmetic (csrc/metal/dispatch.cpp) that the emulator tests also call.
// Each block is bound with setBytes as one `constant` argument.
//
// Layout rules: 64-bit fields first, then 32-bit ones, no implicit padding;
// every size is pinned by a static_assert that the Metal compiler, the
// emulator and the host compiler all evaluate.
#pragma once

#ifdef __METAL_VERSION__
typedef long mlxq_i64;
#else
#include <cstdint>
typedef int64_t mlxq_i64;
#endif

// Mask kinds of MlxqSdpaParams::mask_kind: mlxq's MaskCode (csrc/sdpa_codes.h,
// checked in csrc/metal/kernels.cpp); an array mask's elements are mask_dtype.
#define MQ_MASK_NONE 0
#define MQ_MASK_CAUSAL 1
#define MQ_MASK_ARRAY 2

// Element codes (scales/biases dtype, mask dtype): mlxq's DtypeCode.
#define MQ_DT_F32 0
#define MQ_DT_F16 1
#define MQ_DT_BF16 2
#define MQ_DT_BOOL 3

// The array of a quantized triple that one QuantizedRingUpdate writes
// (MlxqRingParams::part; the values of QuantizedRingUpdate::Part).
#define MQ_PART_CODES 0
#define MQ_PART_SCALES 1
#define MQ_PART_BIASES 2
#define MQ_PART_ALL 3 // QuantizedKVUpdate: codes, scales and biases in one dispatch

// Keys per tile of the attention kernels: one per SIMD lane.
#define MQ_TILE_KEYS 32
// Most rows (query head x query position) one threadgroup serves: one SIMD
// group per row.
#define MQ_MAX_ROW_TILE 16

// QuantizedSDPA decode, prefill and merge kernels.
// A "row" is one (query position l, query head h) of a KV head's GQA group:
// r = l * rep + (h - kvh * rep), rows = rep * L per (batch, KV head).
struct MlxqSdpaParams {
  // Strides in elements. K/V arrays are [B, Hkv, N, *] with a contiguous
  // last axis; q is [B, Hq, L, Dk] and the mask [B, Hq, L, N], any strides.
  mlxq_i64 q_strides[4];
  mlxq_i64 kw_strides[3];
  mlxq_i64 ks_strides[3];
  mlxq_i64 kb_strides[3];
  mlxq_i64 vw_strides[3];
  mlxq_i64 vs_strides[3];
  mlxq_i64 vb_strides[3];
  mlxq_i64 m_strides[4];
  mlxq_i64 sinks_stride;
  int B, Hq, Hkv, L, N, Dk, Dv, rep;
  int k_group_size, v_group_size; // group sizes of K and V
  int k_bits, v_bits;   // code widths (the kernels read them when built for
                        // run-time widths, MQ_STAGE_BITS)
  int rows;        // rep * L
  int row_tile;    // rows per threadgroup (= SIMD groups per threadgroup)
  int row_tiles;   // ceil(rows / row_tile)
  int n_blocks;    // key blocks (split-K); 1 for prefill
  int block_keys;  // keys per block
  int mask_kind;   // MQ_MASK_*
  int mask_dtype;  // MQ_DT_* of an array mask (MQ_DT_BOOL: true attends)
  int scale_dtype; // MQ_DT_* of scales and biases
  int has_sinks;
  int direct;      // 1: write the normalised output; 0: write partials
  int k_vec4;      // K packed rows may be staged with 16-byte loads
  int v_vec4;
  float scale;
  int with_lse; // 1: the merge also writes each row's log-sum-exp (and runs
                // for a single key block too)
};
static_assert(sizeof(MlxqSdpaParams) == 27 * 8 + 26 * 4, "MlxqSdpaParams layout");

// RingUpdate and QuantizedRingUpdate: the output buffer is row-contiguous
// [B, H, S, D] (or, quantized, one part: [B, H, S, W] words or [B, H, S, G]
// scales or biases); the update [B, H, T, D] is read through its strides.
// pos is a device int32.
struct MlxqRingParams {
  mlxq_i64 upd_strides[4];
  int B, H, S, T, D;
  int group_size, bits;
  int W;  // packed words per row (quantized)
  int G;  // groups per row (quantized)
  int part;  // quantized: the part written, MQ_PART_* (0 for RingUpdate)
};
static_assert(sizeof(MlxqRingParams) == 4 * 8 + 10 * 4, "MlxqRingParams layout");

// Strided 4-D copy into a row-contiguous destination of the same shape.
struct MlxqCopyParams {
  mlxq_i64 src_strides[4];
  int shape[4];
};
static_assert(sizeof(MlxqCopyParams) == 4 * 8 + 4 * 4, "MlxqCopyParams layout");

// DequantizeInto: packed [B, H, N, W] uint32 and scales / biases
// [B, H, N, G] (MQ_DT_* scale_dtype), all read through their strides in
// elements, into a row-contiguous [B, H, N, D] output.
struct MlxqDequantParams {
  mlxq_i64 w_strides[4];
  mlxq_i64 s_strides[4];
  mlxq_i64 b_strides[4];
  int B, H, N, D;
  int group_size, bits;
  int scale_dtype;
  int reserved;
};
static_assert(sizeof(MlxqDequantParams) == 12 * 8 + 8 * 4, "MlxqDequantParams layout");

// Fill of n_words 32-bit words with one pattern, word i = y * cols + x of a
// 2-D grid (DequantizeInto's output poisoning, in stream order).
struct MlxqFillParams {
  mlxq_i64 n_words;
  unsigned int pattern;
  int cols;
};
static_assert(sizeof(MlxqFillParams) == 8 + 2 * 4, "MlxqFillParams layout");
