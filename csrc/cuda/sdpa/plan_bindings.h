// Python access to CUDA's attention plan (csrc/cuda/sdpa/plan.h), compiled
// on every platform: mlxq._ext._cuda_plan_sdpa(problem, layout, limits,
// decode, tiled, generic_smem) takes dicts and returns the plan as a dict,
// so the kernel choice, splits and merges are tested without a GPU.
// Included by bindings.cpp.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda/sdpa/plan.h"
#include "dict_args.h"

namespace mlxq::cuda {

namespace nb = nanobind;

namespace plan_py {

using dict_args::get;

inline SdpaProblem problem(const nb::dict& d) {
  SdpaProblem p;
  p.B = get<int>(d, "B", 1);
  p.Hq = get<int>(d, "Hq", 1);
  p.Hkv = get<int>(d, "Hkv", 1);
  p.L = get<int>(d, "L", 1);
  p.N = get<int>(d, "N", 0);
  p.Dk = get<int>(d, "Dk", 128);
  p.Dv = get<int>(d, "Dv", p.Dk);
  p.rep = p.Hq / std::max(1, p.Hkv);
  p.k_bits = get<int>(d, "bits", 4);
  p.k_group_size = get<int>(d, "group_size", 64);
  p.v_bits = get<int>(d, "v_bits", p.k_bits);
  p.v_group_size = get<int>(d, "v_group_size", p.k_group_size);
  p.q_dtype = static_cast<DtypeCode>(get<int>(d, "q_dtype", kBF16));
  p.scale_dtype = static_cast<DtypeCode>(get<int>(d, "scale_dtype", p.q_dtype));
  p.mask = static_cast<MaskCode>(get<int>(d, "mask", kMaskNone));
  p.mask_dtype = static_cast<DtypeCode>(get<int>(d, "mask_dtype", kBool));
  p.has_sinks = get<bool>(d, "has_sinks", false);
  p.with_lse = get<bool>(d, "with_lse", false);
  p.recent = get<int>(d, "recent", 0);
  return p;
}

inline nb::dict sdpa(
    const nb::dict& prob,
    const nb::dict& lay,
    const nb::dict& lim,
    const nb::dict& dec,
    const nb::dict& til,
    int generic_smem) {
  const SdpaProblem p = problem(prob);
  Layout layout;
  layout.vec_loads = get<bool>(lay, "vec_loads", true);
  layout.dense_kv = get<bool>(lay, "dense_kv", true);
  layout.head_fits_32bit = get<bool>(lay, "head_fits_32bit", true);
  layout.packed_unit_stride = get<bool>(lay, "packed_unit_stride", true);
  Limits limits;
  limits.sm_count = get<int>(lim, "sm_count", limits.sm_count);
  limits.max_smem = get<int>(lim, "max_smem", limits.max_smem);
  limits.decode_on = get<bool>(lim, "decode_on", true);
  limits.tiled_on = get<bool>(lim, "tiled_on", true);
  limits.fused_merge_on = get<bool>(lim, "fused_merge_on", true);
  limits.dense_on = get<bool>(lim, "dense_on", true);
  limits.gemm_on = get<bool>(lim, "gemm_on", true);
  limits.fused_recent_on = get<bool>(lim, "fused_recent_on", true);
  limits.gemm_min_keys = get<int>(lim, "gemm_min_keys", kGemmMinKeys);
  limits.gemm_block_elements = get<int64_t>(lim, "gemm_block_elements", kGemmBlockElements);
  DecodeShape decode;
  decode.available = get<bool>(dec, "available", false);
  decode.smem = get<int>(dec, "smem", 0);
  decode.max_rows = get<int>(dec, "max_rows", 0);
  decode.step_keys = get<int>(dec, "step_keys", 0);
  decode.merge_smem = get<int>(dec, "merge_smem", 0);
  decode.blocks_per_sm = get<int>(dec, "blocks_per_sm", 1);
  TiledShape tiled;
  tiled.available = get<bool>(til, "available", false);
  tiled.smem = get<int>(til, "smem", 0);
  tiled.threads = get<int>(til, "threads", 0);
  tiled.rows = get<int>(til, "rows", 0);
  tiled.keys = get<int>(til, "keys", 0);
  tiled.dense = get<bool>(til, "dense", false);
  tiled.blocks_per_sm = get<int>(til, "blocks_per_sm", 1);
  const Plan plan = plan_sdpa(p, layout, limits, decode, tiled, generic_smem);
  nb::dict out;
  out["kernel"] = std::string(family_name(plan.family));
  out["rows"] = plan.rows;
  out["head_groups"] = plan.head_groups;
  out["head_group_magic"] = head_group_magic(plan.head_groups);
  out["row_tile"] = plan.row_tile;
  out["row_tiles"] = plan.row_tiles;
  out["splits"] = plan.splits;
  out["split_keys"] = plan.split_keys;
  out["grid"] = nb::make_tuple(plan.grid[0], plan.grid[1], plan.grid[2]);
  out["threads"] = plan.threads;
  out["smem"] = plan.smem;
  out["merge_kernel"] = plan.merge_kernel;
  out["fused_merge"] = plan.fused_merge;
  out["partial_slots"] = plan.partial_slots;
  out["dense_copy"] = plan.dense_copy;
  out["recent_splits"] = plan.recent_splits;
  out["block_keys"] = plan.block_keys;
  out["blocks"] = plan.blocks;
  // Which tiled instance the host looks up for this problem.
  out["dense_candidate"] = dense_tiled_candidate(p, layout, limits);
  return out;
}

} // namespace plan_py

inline void add_plan_bindings(nb::module_& m) {
  m.def(
      "_cuda_plan_sdpa",
      [](const nb::dict& problem,
         const nb::dict& layout,
         const nb::dict& limits,
         const nb::dict& decode,
         const nb::dict& tiled,
         int generic_smem) {
        try {
          return plan_py::sdpa(problem, layout, limits, decode, tiled, generic_smem);
        } catch (const std::invalid_argument& e) {
          throw nb::value_error(e.what());
        }
      },
      nb::arg("problem"),
      nb::arg("layout") = nb::dict(),
      nb::arg("limits") = nb::dict(),
      nb::arg("decode") = nb::dict(),
      nb::arg("tiled") = nb::dict(),
      nb::arg("generic_smem") = 0,
      "Test hook: CUDA's attention plan (kernel family, grid, splits, merge) for a problem.");
}

} // namespace mlxq::cuda
