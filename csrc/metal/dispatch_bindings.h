// Python access to the Metal grid arithmetic (csrc/metal/dispatch.h) for the
// emulator tests: mlxq._ext._metal_plan_sdpa / _metal_plan_ring_update /
// _metal_plan_quantized_ring_update / _metal_plan_copy4d /
// _metal_plan_dequantize_into / _metal_plan_fill take a dict and
// return a dict with the kernel name, grid and threadgroup sizes, the
// argument block as bytes, and the buffer slots. Included by bindings.cpp.
#pragma once

#include <initializer_list>
#include <utility>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "dict_args.h"
#include "metal/dispatch.h"

namespace mlxq::metal_dispatch {

namespace nb = nanobind;

namespace py {

using dict_args::get;

template <size_t N>
void get_strides(const nb::dict& d, const char* key, int64_t (&out)[N]) {
  if (!d.contains(key)) {
    return;
  }
  nb::sequence seq = nb::cast<nb::sequence>(d[key]);
  if (nb::len(seq) != N) {
    throw std::invalid_argument(std::string(key) + " needs " + std::to_string(N) + " strides");
  }
  for (size_t i = 0; i < N; ++i) {
    out[i] = nb::cast<int64_t>(seq[i]);
  }
}

inline nb::tuple size3(const Size3& s) {
  return nb::make_tuple(s.x, s.y, s.z);
}

template <typename P>
nb::bytes raw(const P& params) {
  return nb::bytes(reinterpret_cast<const char*>(&params), sizeof(P));
}

inline nb::dict sdpa(const nb::dict& d) {
  SdpaProblem pr;
  pr.B = get<int>(d, "B", 1);
  pr.Hq = get<int>(d, "Hq", 1);
  pr.Hkv = get<int>(d, "Hkv", 1);
  pr.L = get<int>(d, "L", 1);
  pr.N = get<int>(d, "N", 0);
  pr.Dk = get<int>(d, "Dk", 0);
  pr.Dv = get<int>(d, "Dv", pr.Dk);
  pr.k_bits = get<int>(d, "bits", 4);
  pr.k_group_size = get<int>(d, "group_size", 64);
  pr.v_bits = get<int>(d, "v_bits", pr.k_bits);
  pr.v_group_size = get<int>(d, "v_group_size", pr.k_group_size);
  pr.q_dtype = get<int>(d, "q_dtype", MQ_DT_F32);
  pr.scale_dtype = get<int>(d, "scale_dtype", MQ_DT_F32);
  pr.mask_kind = get<int>(d, "mask_kind", MQ_MASK_NONE);
  pr.mask_dtype = get<int>(d, "mask_dtype", MQ_DT_BOOL);
  pr.has_sinks = get<bool>(d, "has_sinks", false);
  pr.scale = get<float>(d, "scale", 1.0f);
  get_strides(d, "q_strides", pr.q_strides);
  const char* kn[3] = {"k_packed_strides", "k_scales_strides", "k_biases_strides"};
  const char* vn[3] = {"v_packed_strides", "v_scales_strides", "v_biases_strides"};
  for (int i = 0; i < 3; ++i) {
    get_strides(d, kn[i], pr.k_strides[i]);
    get_strides(d, vn[i], pr.v_strides[i]);
  }
  pr.k_packed_offset = get<int64_t>(d, "k_packed_offset", 0);
  pr.v_packed_offset = get<int64_t>(d, "v_packed_offset", 0);
  pr.k_base_aligned16 = get<bool>(d, "k_base_aligned16", true);
  pr.v_base_aligned16 = get<bool>(d, "v_base_aligned16", true);
  get_strides(d, "mask_strides", pr.m_strides);
  pr.sinks_stride = get<int64_t>(d, "sinks_stride", 1);
  pr.with_lse = get<bool>(d, "with_lse", false);
  pr.mode = static_cast<SdpaMode>(get<int>(d, "mode", 0));
  pr.target_threadgroups = get<int>(d, "target_threadgroups", kTargetThreadgroups);
  pr.min_block_keys = get<int>(d, "min_block_keys", kMinBlockKeys);
  pr.max_threads = get<int>(d, "max_threads", 1024);

  const SdpaPlan plan = plan_sdpa(pr);
  nb::dict r;
  r["kernel"] = plan.kernel;
  r["grid"] = size3(plan.grid);
  r["group"] = size3(plan.group);
  r["prefill"] = plan.prefill;
  r["merge"] = plan.merge;
  r["merge_kernel"] = plan.merge_kernel;
  r["merge_grid"] = size3(plan.merge_grid);
  r["merge_group"] = size3(plan.merge_group);
  r["partial_o_floats"] = plan.partial_o_floats;
  r["partial_ml_floats"] = plan.partial_ml_floats;
  r["n_blocks"] = plan.params.n_blocks;
  r["block_keys"] = plan.params.block_keys;
  r["row_tile"] = plan.params.row_tile;
  r["row_tiles"] = plan.params.row_tiles;
  r["k_vec4"] = plan.params.k_vec4 != 0;
  r["v_vec4"] = plan.params.v_vec4 != 0;
  r["params"] = raw(plan.params);
  nb::dict s;
  s["q"] = slots::kQ;
  s["k_packed"] = slots::kKPacked;
  s["k_scales"] = slots::kKScales;
  s["k_biases"] = slots::kKBiases;
  s["v_packed"] = slots::kVPacked;
  s["v_scales"] = slots::kVScales;
  s["v_biases"] = slots::kVBiases;
  s["mask"] = slots::kMask;
  s["sinks"] = slots::kSinks;
  s["out"] = slots::kOut;
  s["partial_o"] = slots::kPartialO;
  s["partial_ml"] = slots::kPartialML;
  s["params"] = slots::kSdpaParams;
  r["slots"] = s;
  nb::dict ms;
  ms["partial_o"] = slots::kMergePartialO;
  ms["partial_ml"] = slots::kMergePartialML;
  ms["sinks"] = slots::kMergeSinks;
  ms["out"] = slots::kMergeOut;
  ms["params"] = slots::kMergeParams;
  ms["lse"] = slots::kMergeLse;
  r["merge_slots"] = ms;
  return r;
}

// An elementwise plan as a dict: kernel, grid, its params' bytes and the
// buffer slots the host binds (name -> index).
template <typename Plan>
nb::dict elementwise(const Plan& plan, std::initializer_list<std::pair<const char*, int>> slots) {
  nb::dict r;
  r["kernel"] = plan.kernel;
  r["grid"] = size3(plan.grid);
  r["group"] = size3(plan.group);
  r["grid_is_threads"] = plan.grid_is_threads;
  r["params"] = raw(plan.params);
  nb::dict s;
  for (const auto& [name, index] : slots) {
    s[name] = index;
  }
  r["slots"] = s;
  return r;
}

inline nb::dict ring(const nb::dict& d) {
  int64_t st[4] = {0, 0, 0, 1};
  get_strides(d, "update_strides", st);
  const RingPlan plan = plan_ring_update(
      get<int>(d, "B", 1),
      get<int>(d, "H", 1),
      get<int>(d, "S", 1),
      get<int>(d, "T", 1),
      get<int>(d, "D", 1),
      get<int>(d, "itemsize", 4),
      st);
  nb::dict r = elementwise(
      plan,
      {{"update", slots::kRingUpdate},
       {"pos", slots::kRingPos},
       {"out", slots::kRingOut},
       {"params", slots::kRingParams}});
  return r;
}

inline nb::dict quantized_ring(const nb::dict& d) {
  int64_t st[4] = {0, 0, 0, 1};
  get_strides(d, "update_strides", st);
  const RingPlan plan = plan_quantized_ring_update(
      get<int>(d, "B", 1),
      get<int>(d, "H", 1),
      get<int>(d, "S", 1),
      get<int>(d, "T", 1),
      get<int>(d, "D", 32),
      get<int>(d, "group_size", 64),
      get<int>(d, "bits", 4),
      get<int>(d, "dtype", MQ_DT_F32),
      get<int>(d, "part", MQ_PART_CODES),
      st);
  nb::dict r = elementwise(
      plan,
      {{"update", slots::kQRingUpdate},
       {"pos", slots::kQRingPos},
       {"packed", slots::kQRingPacked},
       {"scales", slots::kQRingScales},
       {"biases", slots::kQRingBiases},
       {"params", slots::kQRingParams}});
  r["part"] = plan.params.part;
  return r;
}

inline nb::dict copy4d(const nb::dict& d) {
  int64_t st[4] = {0, 0, 0, 1};
  int64_t sh[4] = {1, 1, 1, 1};
  get_strides(d, "strides", st);
  get_strides(d, "shape", sh);
  const int shape[4] = {int(sh[0]), int(sh[1]), int(sh[2]), int(sh[3])};
  const CopyPlan plan = plan_copy4d(shape, st, get<int>(d, "itemsize", 4));
  nb::dict r = elementwise(
      plan, {{"src", slots::kCopySrc}, {"dst", slots::kCopyDst}, {"params", slots::kCopyParams}});
  return r;
}

inline nb::dict dequantize_into(const nb::dict& d) {
  int64_t w[4] = {0, 0, 0, 1}, sc[4] = {0, 0, 0, 1}, bi[4] = {0, 0, 0, 1};
  get_strides(d, "packed_strides", w);
  get_strides(d, "scales_strides", sc);
  get_strides(d, "biases_strides", bi);
  const DequantPlan plan = plan_dequantize_into(
      get<int>(d, "B", 1),
      get<int>(d, "H", 1),
      get<int>(d, "N", 1),
      get<int>(d, "D", 64),
      get<int>(d, "group_size", 64),
      get<int>(d, "bits", 4),
      get<int>(d, "out_dtype", MQ_DT_F32),
      get<int>(d, "scale_dtype", MQ_DT_F32),
      w,
      sc,
      bi);
  nb::dict r = elementwise(
      plan,
      {{"packed", slots::kDqPacked},
       {"scales", slots::kDqScales},
       {"biases", slots::kDqBiases},
       {"out", slots::kDqOut},
       {"params", slots::kDqParams}});
  r["order_slot"] = slots::kDqOrder; // bound by the host, never read
  return r;
}

inline nb::dict fill(const nb::dict& d) {
  const int dtype = get<int>(d, "dtype", MQ_DT_F32);
  const uint32_t pattern =
      d.contains("pattern") ? nb::cast<uint32_t>(d["pattern"]) : poison_word(dtype);
  const FillPlan plan = plan_fill_u32(get<int64_t>(d, "n_words", 0), pattern);
  nb::dict r = elementwise(plan, {{"dst", slots::kFillDst}, {"params", slots::kFillParams}});
  r["pattern"] = plan.params.pattern;
  r["order_slot"] = slots::kFillOrder;
  return r;
}

} // namespace py

inline void add_plan_bindings(nb::module_& m) {
  struct Hook {
    const char* name;
    nb::dict (*plan)(const nb::dict&);
    const char* doc;
  };
  const Hook hooks[] = {
      {"_metal_plan_sdpa",
       &py::sdpa,
       "Test hook: the Metal dispatch of a QuantizedSDPA problem (dict in, dict out)."},
      {"_metal_plan_ring_update", &py::ring, "Test hook: the Metal dispatch of a RingUpdate."},
      {"_metal_plan_quantized_ring_update",
       &py::quantized_ring,
       "Test hook: the Metal dispatch of a QuantizedRingUpdate."},
      {"_metal_plan_copy4d", &py::copy4d, "Test hook: the Metal dispatch of a strided copy."},
      {"_metal_plan_dequantize_into",
       &py::dequantize_into,
       "Test hook: the Metal dispatch of a DequantizeInto."},
      {"_metal_plan_fill",
       &py::fill,
       "Test hook: the Metal dispatch of the poisoning fill (dtype's poison word unless a "
       "pattern is given)."},
  };
  for (const Hook& h : hooks) {
    m.def(h.name, h.plan, nb::arg("problem"), h.doc);
  }
}

} // namespace mlxq::metal_dispatch
