#include "cuda/sdpa/plan.h"

#include <algorithm>

#include "cuda/kernel_args.h"
#include "row_tiling.h"

namespace mlxq::cuda {

namespace {

bool half_queries(const SdpaProblem& p) {
  return p.q_dtype == kF16 || p.q_dtype == kBF16;
}

// A fused split merge holds every split's (max, sum) of a head in shared
// memory and folds its partial outputs in one block: worth it while a head's
// partials are small (128 KB: 32/8/128 at 128k keys folds 100 KB per head,
// measured faster fused); with few KV heads the splits multiply and
// merge_kernel's many blocks win.
bool fuse_merge(const Plan& plan, const SdpaProblem& p, const DecodeShape& d, bool on) {
  const long head_partials = long(plan.splits) * plan.rows * p.Dv * 4;
  return on && (long(plan.splits) * plan.rows + plan.rows) * 4 <= d.merge_smem &&
      head_partials <= 128 * 1024;
}

// Decode: one partial per block of kDecodeWarps warps, splits of whole warp
// steps, enough blocks for one wave of the kernel's occupancy at any N.
void plan_decode(Plan& plan, const SdpaProblem& p, const Limits& limits, const DecodeShape& d) {
  const long units = long(p.B) * p.Hkv;
  const long want = long(d.blocks_per_sm) * limits.sm_count;
  // Sized and counted over N's key class, as plan_row_tiles does (see
  // row_tiling.h): a masked whole-buffer step splits like an exact one.
  const long n_class = key_class(p.N);
  long splits = std::max(1L, (want + units - 1) / units);
  splits = std::min<long>(splits, (n_class + d.step_keys - 1) / d.step_keys);
  int keys = int((n_class + splits - 1) / splits);
  keys = (keys + d.step_keys - 1) / d.step_keys * d.step_keys;
  plan.family = Family::Decode;
  plan.row_tile = plan.rows;
  plan.row_tiles = 1;
  plan.split_keys = keys;
  plan.splits = int((n_class + keys - 1) / keys);
  plan.grid[0] = plan.splits;
  plan.grid[1] = p.Hkv;
  plan.grid[2] = p.B;
  plan.threads = kDecodeWarps * 32;
  plan.smem = d.smem;
  if (p.recent > 0 && limits.fused_recent_on) {
    plan.recent_splits = (p.recent + kRecentKeys - 1) / kRecentKeys;
    plan.splits += plan.recent_splits;
    plan.grid[0] = plan.splits;
  }
  plan.fused_merge = fuse_merge(plan, p, d, limits.fused_merge_on);
  plan.merge_kernel = !plan.fused_merge; // a decode block always writes a partial
}

// Keys per block: the score budget over the rows of all (batch, KV head)
// pairs, in whole 256-key steps, no more than the keys (rounded up).
void plan_gemm(Plan& plan, const SdpaProblem& p, const Limits& limits) {
  const int64_t rows = int64_t(p.B) * p.Hkv * p.rows();
  int64_t keys = limits.gemm_block_elements / rows / 256 * 256;
  keys = std::min<int64_t>(keys, (int64_t(p.N) + 255) / 256 * 256);
  keys = std::max<int64_t>(256, std::min<int64_t>(keys, kGemmMaxBlockKeys));
  plan.family = Family::Gemm;
  plan.block_keys = int(keys);
  plan.blocks = int((p.N + keys - 1) / keys);
  plan.grid[0] = rows; // the fold's and the finish's blocks: one per row
  plan.threads = kGemmThreads;
  plan.dense_copy = true;
}

void set_tiling(Plan& plan, const RowTiling& t) {
  plan.row_tile = t.row_tile;
  plan.row_tiles = t.row_tiles;
  plan.splits = t.splits;
  plan.split_keys = t.split_keys;
}

} // namespace

const char* family_name(Family f) {
  switch (f) {
    case Family::Decode:
      return "cuda_decode";
    case Family::Tiled:
      return "cuda_tiled";
    case Family::Gemm:
      return "cuda_gemm";
    default:
      return "cuda_generic";
  }
}

int decode_head_groups(const SdpaProblem& p, int max_rows) {
  if (p.rows() <= max_rows) {
    return 1;
  }
  if (p.L != 1) {
    return 0;
  }
  for (int g = 2; g <= p.rep; ++g) {
    if (p.rep % g == 0 && p.rep / g <= max_rows) {
      return g;
    }
  }
  return 0;
}

SdpaProblem grouped(const SdpaProblem& p, int groups) {
  SdpaProblem v = p;
  v.Hkv = p.Hkv * groups;
  v.rep = p.rep / groups;
  return v;
}

uint32_t head_group_magic(int groups) {
  if (groups <= 1) {
    return 0;
  }
  return uint32_t(((uint64_t(1) << 32) + uint64_t(groups) - 1) / uint64_t(groups));
}

// The decode kernel stages K and V rows of one quantization, or 8-bit keys
// with 4-bit values (whose group sizes it has instances of), under no mask,
// a causal one or an array (bool or additive, read per score); the tiled
// kernel over codes only the first, so other mixed pairs reach it as the
// dense tiled kernel's (or the GEMM family's) dequantized copies.
bool decode_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits) {
  const bool pair = p.same_quantization() || (p.k_bits == 8 && p.v_bits == 4);
  return limits.decode_on && half_queries(p) && p.Dk == p.Dv && pair && layout.vec_loads &&
      p.N >= 1 && layout.head_fits_32bit && layout.dense_kv;
}

namespace {

bool tiled_shape_ok(const SdpaProblem& p, const Layout& layout, const Limits& limits) {
  return limits.tiled_on && half_queries(p) && p.Dk == p.Dv && p.rows() > kMaxTileRows &&
      p.N >= 1 && layout.packed_unit_stride && layout.head_fits_32bit;
}

} // namespace

bool dense_tiled_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits) {
  return limits.dense_on && tiled_shape_ok(p, layout, limits) && (p.Dk == 256 || p.Dk == 512) &&
      p.rows() >= kDenseMinRows;
}

bool tiled_candidate(const SdpaProblem& p, const Layout& layout, const Limits& limits) {
  return tiled_shape_ok(p, layout, limits) &&
      (p.same_quantization() || dense_tiled_candidate(p, layout, limits));
}

bool gemm_candidate(const SdpaProblem& p, const Limits& limits) {
  return limits.gemm_on && limits.dense_on && half_queries(p) && p.Dk == p.Dv &&
      (p.Dk == 256 || p.Dk == 512) && p.rows() >= kDenseMinRows && p.N >= limits.gemm_min_keys &&
      p.mask != kMaskArray && (p.mask != kMaskCausal || p.L <= p.N);
}

bool decode_fits(const SdpaProblem& p, const Limits& limits, const DecodeShape& decode) {
  return decode.available && decode_head_groups(p, decode.max_rows) > 0 &&
      decode.smem <= limits.max_smem;
}

bool tiled_fits(const Limits& limits, const TiledShape& tiled) {
  return tiled.available && tiled.smem <= limits.max_smem;
}

Plan plan_sdpa(
    const SdpaProblem& p,
    const Layout& layout,
    const Limits& limits,
    const DecodeShape& decode,
    const TiledShape& tiled,
    int generic_smem) {
  Plan plan;
  plan.rows = p.rows();
  if (decode_candidate(p, layout, limits) && decode_fits(p, limits, decode)) {
    plan.head_groups = decode_head_groups(p, decode.max_rows);
    const SdpaProblem g = grouped(p, plan.head_groups);
    plan.rows = g.rows();
    plan_decode(plan, g, limits, decode);
  } else if (gemm_candidate(p, limits)) {
    plan_gemm(plan, p, limits);
  } else if (tiled_candidate(p, layout, limits) && tiled_fits(limits, tiled)) {
    // Row tiles of the block's rows; keys split only while the row tiles
    // alone leave SMs idle (few rows over many keys).
    const long want = long(tiled.blocks_per_sm) * limits.sm_count;
    set_tiling(
        plan, plan_row_tiles(p.B, p.Hkv, p.rep, p.L, p.N, tiled.rows, want, 256, tiled.keys));
    plan.family = Family::Tiled;
    plan.grid[0] = int64_t(p.Hkv) * plan.row_tiles;
    plan.grid[1] = plan.splits;
    plan.grid[2] = p.B;
    plan.threads = tiled.threads;
    plan.smem = tiled.smem;
    plan.merge_kernel = plan.splits > 1;
    plan.dense_copy = tiled.dense;
  } else {
    // Enough blocks for a few per SM at any N, in whole tiles of at least
    // 4 x kTileKeys keys per split.
    set_tiling(
        plan,
        plan_row_tiles(
            p.B,
            p.Hkv,
            p.rep,
            p.L,
            p.N,
            kMaxTileRows,
            4L * limits.sm_count,
            4 * kTileKeys,
            kTileKeys));
    plan.family = Family::Generic;
    plan.grid[0] = int64_t(p.Hkv) * plan.row_tiles;
    plan.grid[1] = plan.splits;
    plan.grid[2] = p.B;
    plan.threads = kBlockThreads;
    plan.smem = generic_smem;
    plan.merge_kernel = plan.splits > 1;
  }
  if (p.with_lse && !plan.fused_merge && plan.family != Family::Gemm) {
    plan.merge_kernel = true; // the merge writes the log-sum-exp (GEMM: its finish)
  }
  if (plan.merge_kernel || plan.fused_merge) {
    plan.partial_slots = int64_t(p.B) * p.Hkv * plan.head_groups * plan.row_tiles * plan.splits *
        int64_t(plan.row_tile);
  }
  return plan;
}

} // namespace mlxq::cuda
