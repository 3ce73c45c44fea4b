// Which CUDA attention kernel runs a QuantizedSDPA problem, and how it is cut
// into blocks, splits and merges: one pure function of the problem, the
// operands' layout, the device's limits and the candidate kernels' shapes.
//
// Plain C++ (no CUDA or MLX GPU headers): compiled on every platform and
// tested without a GPU through `_ext._cuda_plan_sdpa`. The CUDA host code
// (csrc/cuda/quantized_sdpa.cpp) fills the inputs from the arrays and the
// kernel instance tables (occupancy included), then binds and launches what
// the plan says.
#pragma once

#include <cstdint>

#include "sdpa_problem.h"

namespace mlxq::cuda {

enum class Family : int { Decode = 0, Tiled = 1, Generic = 2, Gemm = 3 };
const char* family_name(Family f); // the test hook's "cuda_decode", ...

// Facts about the operands that the kernels' fast paths need.
struct Layout {
  bool vec_loads = true; // K/V packed rows and bases allow 16-byte loads
  bool dense_kv = true; // each key's words, scales and biases consecutive
  bool head_fits_32bit = true; // one (batch, KV head) indexes in 32 bits
  bool packed_unit_stride = true; // packed words contiguous along a row
};

// Keys from which a head dim 256/512 call of many rows runs as GEMMs over
// blocks of keys (Family::Gemm) instead of the dense tiled kernel, and the
// score elements of one block (f32 scratch, reused block after block). On
// the H200, Gemma 4's 32k-key global layer (16384 rows, head dim 512) took
// 6.0 ms in 1024-key blocks (2^24 elements) and 3.4 ms in 4096-key blocks
// (2^26): the fewer the blocks, the fewer rescales of the f32 output and the
// larger the GEMMs.
constexpr int kGemmMinKeys = 4096;
constexpr int64_t kGemmBlockElements = int64_t(1) << 26;

// The device and the switches (MLXQ_CUDA_DECODE / _TILED / _TILED_DENSE /
// _FUSED_MERGE / _GEMM / _FUSED_RECENT, MLXQ_CUDA_GEMM_MIN_KEYS,
// _GEMM_BLOCK_ELEMENTS).
struct Limits {
  int sm_count = 132;
  int max_smem = 227 * 1024; // dynamic shared memory a block may opt into
  bool decode_on = true;
  bool tiled_on = true;
  bool dense_on = true;
  bool fused_merge_on = true;
  bool gemm_on = true;
  bool fused_recent_on = true;
  int gemm_min_keys = kGemmMinKeys;
  int64_t gemm_block_elements = kGemmBlockElements;
};

// Query rows per KV head from which a head dim 256/512 tiled call first
// dequantizes K and V into a dense copy (one O(N * D) pass) for its blocks
// to read: below, few blocks unpack each tile and the pass does not pay.
constexpr int kDenseMinRows = 256;

// A decode instance for the problem's (bits, D, group, dtypes), if any.
struct DecodeShape {
  bool available = false;
  int smem = 0;
  int max_rows = 0; // query rows per KV head it attends at most
  int step_keys = 0; // a split is a whole number of these
  int merge_smem = 0; // shared bytes its fused split merge may use
  int blocks_per_sm = 1; // occupancy at `smem`
};

// The tiled instance for the problem's (q dtype, D, group) and block shape.
struct TiledShape {
  bool available = false;
  int smem = 0;
  int threads = 0;
  int rows = 0; // query rows per block
  int keys = 0; // keys per tile
  bool dense = false; // reads a dense copy of K and V (see kDenseMinRows)
  int blocks_per_sm = 1;
};

struct Plan {
  Family family = Family::Generic;
  int rows = 0; // rep * L rows per (batch, KV head), per head group (decode)
  // Decode: a KV head's query heads attended in this many groups of at most
  // max_rows rows, one block row each (see decode_head_groups). The launch
  // then binds the problem as head_groups times the KV heads (grouped()).
  int head_groups = 1;
  int row_tile = 0;
  int row_tiles = 0;
  int splits = 1;
  int split_keys = 0;
  int64_t grid[3] = {1, 1, 1};
  int threads = 0;
  int smem = 0;
  // How the splits become the output: one split writes it; with several, a
  // decode kernel's last block per head merges them (fused) or merge_kernel
  // does (merge_kernel).
  bool merge_kernel = false;
  bool fused_merge = false;
  // The tiled kernel reads a dense copy of K and V, which the launch first
  // dequantizes into scratch (2 * B * Hkv * N * D elements of the query's
  // dtype).
  bool dense_copy = false;
  int64_t partial_slots = 0; // rows of per-split partials (scratch)
  // Decode with an exact recent window (SdpaProblem::recent): the last this
  // many of a head's splits attend the window, kRecentKeys rows each. 0 with
  // a window (another family, or MLXQ_CUDA_FUSED_RECENT=0): the launch
  // attends the quantized keys with their log-sum-exp, then merges the
  // window in (RecentAttention's kernel).
  int recent_splits = 0;
  // Gemm: keys per block (a multiple of 256, at most kGemmMaxBlockKeys) and
  // blocks; the dense copy comes first (dense_copy).
  int block_keys = 0;
  int blocks = 0;
};

// generic_smem: the generic kernel's shared memory for the problem.
Plan plan_sdpa(
    const SdpaProblem& p,
    const Layout& layout,
    const Limits& limits,
    const DecodeShape& decode,
    const TiledShape& tiled,
    int generic_smem);

// Whether the problem and layout suit a decode / tiled kernel at all: only
// then is its instance looked up.
bool decode_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits);
bool tiled_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits);
// Whether the problem suits the GEMM family: f16/bf16 queries, head dim 256
// or 512, at least kDenseMinRows rows per KV head over gemm_min_keys keys,
// no array mask, and causal only bottom-right with L <= N (every row then
// sees key 0, so every row's first block has a finite max).
bool gemm_candidate(const SdpaProblem& p, const Limits& limits);
// Whether a tiled candidate should take the dense-K/V instance.
bool dense_tiled_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits);

// How many groups a decode step's query heads of one KV head split into so
// that each group has at most max_rows rows: the fewest that divide rep
// (1 when rows() already fit), or 0 when none does (L > 1 with too many
// rows). Multi-head latent attention puts all query heads (16-128) on one
// latent KV head; each group's blocks read the same K/V, the later ones
// mostly from L2.
int decode_head_groups(const SdpaProblem& p, int max_rows);
// The problem as `groups` times the KV heads with rep / groups query heads
// each: query, mask, output and sinks index as before; the decode kernel
// reads KV head (head / groups).
SdpaProblem grouped(const SdpaProblem& p, int groups);
// m with floor(h * m / 2^32) == h / groups for every grid row h < 2^16
// (ceil(2^32 / groups)), or 0 for one group: the decode kernel's KV head.
uint32_t head_group_magic(int groups);

// Whether a looked-up instance exists and fits the problem and the device:
// plan_sdpa takes the first kernel that does, and only those need their
// occupancy queried.
bool decode_fits(const SdpaProblem& p, const Limits& limits, const DecodeShape& decode);
bool tiled_fits(const Limits& limits, const TiledShape& tiled);

} // namespace mlxq::cuda
