// Python access to the prefill route and its workspace (prefill_route.h,
// prefill_workspace.h) for mlxq.routing, mlxq.workspace and their tests.
// Included by bindings.cpp.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "prefill_route.h"
#include "prefill_workspace.h"
#include "translate_errors.h"

namespace mlxq::prefill_bindings {

namespace nb = nanobind;
using namespace nb::literals;

inline GpuBackend backend_named(const std::optional<std::string>& name) {
  if (!name) {
    return GpuBackend::None;
  }
  if (*name == "cuda") {
    return GpuBackend::Cuda;
  }
  if (*name == "metal") {
    return GpuBackend::Metal;
  }
  throw nb::value_error("backend must be \"cuda\", \"metal\" or None.");
}

inline MaskCode mask_named(const std::string& kind) {
  if (kind == "none") {
    return kMaskNone;
  }
  if (kind == "causal") {
    return kMaskCausal;
  }
  if (kind == "array") {
    return kMaskArray;
  }
  throw nb::value_error("mask_kind must be \"none\", \"causal\" or \"array\".");
}

inline void add(nb::module_& m) {
  m.def(
      "_gpu_backend",
      []() -> std::optional<std::string> {
        switch (gpu_backend()) {
          case GpuBackend::Cuda:
            return "cuda";
          case GpuBackend::Metal:
            return "metal";
          case GpuBackend::None:
            break;
        }
        return std::nullopt;
      },
      "The GPU backend this build of mlxq runs: \"cuda\", \"metal\" or None.");

  m.def(
      "_route_to_mx_fast",
      [](const std::optional<std::string>& backend,
         int L,
         int N,
         int Hq,
         int Hkv,
         int Dk,
         int Dv,
         mx::Dtype dtype,
         mx::Dtype scales_dtype,
         const std::string& mask_kind,
         std::optional<mx::Dtype> sinks_dtype) {
        PrefillProblem p{
            L, N, Hq, Hkv, Dk, Dv, dtype, scales_dtype, mask_named(mask_kind), sinks_dtype};
        return route_to_mx_fast(backend_named(backend), p);
      },
      "backend"_a.none(),
      nb::kw_only(),
      "L"_a,
      "N"_a,
      "Hq"_a,
      "Hkv"_a,
      "Dk"_a,
      "Dv"_a,
      "dtype"_a,
      "scales_dtype"_a,
      "mask_kind"_a,
      "sinks_dtype"_a = nb::none(),
      "Test hook: quantized_sdpa's decision to dequantize and compose MLX's fused attention "
      "on `backend` (\"cuda\", \"metal\" or None: the CPU).");

  m.def(
      "_take_route_counts",
      &take_route_counts,
      "Test hook: quantized attention calls routed to mx.fast since the last call (then "
      "resets).");

  m.def(
      "_workspace_dequantize_kv",
      [](const mx::array& k_packed,
         const mx::array& k_scales,
         const mx::array& k_biases,
         const mx::array& v_packed,
         const mx::array& v_scales,
         const mx::array& v_biases,
         int group_size,
         int bits,
         int v_group_size,
         int v_bits,
         mx::Dtype dtype,
         mx::StreamOrDevice s) {
        return bindings::translate_errors([&] {
          return workspace::dequantize_kv(
              k_packed,
              k_scales,
              k_biases,
              v_packed,
              v_scales,
              v_biases,
              group_size,
              bits,
              v_group_size,
              v_bits,
              dtype,
              mx::to_stream(s));
        });
      },
      "k_packed"_a,
      "k_scales"_a,
      "k_biases"_a,
      "v_packed"_a,
      "v_scales"_a,
      "v_biases"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "v_group_size"_a,
      "v_bits"_a,
      "dtype"_a,
      "stream"_a = nb::none(),
      "K and V dequantized into the stream's workspace buffers (see mlxq.workspace).");

  m.def(
      "_dequantized_attention",
      [](const mx::array& q,
         const mx::array& k_packed,
         const mx::array& k_scales,
         const mx::array& k_biases,
         const mx::array& v_packed,
         const mx::array& v_scales,
         const mx::array& v_biases,
         float scale,
         bool causal,
         const std::optional<mx::array>& sinks,
         int group_size,
         int bits,
         int v_group_size,
         int v_bits,
         const std::optional<mx::array>& exact_keys,
         const std::optional<mx::array>& exact_values,
         std::optional<int> rows,
         mx::StreamOrDevice s) {
        return bindings::translate_errors([&]() -> std::optional<mx::array> {
          std::optional<ExactRows> exact;
          int n = rows.value_or(k_packed.shape(2)), N = n;
          if (exact_keys && exact_values) {
            exact = ExactRows{*exact_keys, *exact_values, n};
            N += exact_keys->shape(2);
          }
          PrefillProblem p{
              q.shape(2),
              N,
              q.shape(1),
              k_packed.shape(1),
              q.shape(3),
              exact_values ? static_cast<int>(exact_values->shape(3)) : 0,
              q.dtype(),
              k_scales.dtype(),
              causal ? kMaskCausal : kMaskNone,
              std::nullopt};
          return dequantized_attention(
              q,
              k_packed,
              k_scales,
              k_biases,
              v_packed,
              v_scales,
              v_biases,
              p,
              scale,
              group_size,
              bits,
              v_group_size,
              v_bits,
              sinks,
              exact,
              /*force_fused=*/false,
              mx::to_stream(s));
        });
      },
      "q"_a,
      "k_packed"_a,
      "k_scales"_a,
      "k_biases"_a,
      "v_packed"_a,
      "v_scales"_a,
      "v_biases"_a,
      nb::kw_only(),
      "scale"_a,
      "causal"_a,
      "sinks"_a = nb::none(),
      "group_size"_a,
      "bits"_a,
      "v_group_size"_a,
      "v_bits"_a,
      "exact_keys"_a = nb::none(),
      "exact_values"_a = nb::none(),
      "rows"_a = nb::none(),
      "stream"_a = nb::none(),
      "Test hook: the routed prefill's attention on any stream (MLX's attention over the "
      "K/V rows [0, rows) dequantized, then exact_keys / exact_values), without the decision.");

  m.def(
      "_workspace_note_reader",
      [](const mx::array& out, mx::StreamOrDevice s) {
        workspace::note_reader(mx::to_stream(s), out);
      },
      "out"_a,
      "stream"_a = nb::none(),
      "`out` read the stream's workspace: the next write waits for it.");

  m.def(
      "_workspace_release",
      [](mx::StreamOrDevice s) { workspace::release(mx::to_stream(s)); },
      "stream"_a = nb::none(),
      "Drop the stream's workspace buffers.");

  m.def("_workspace_release_all", &workspace::release_all, "Drop every stream's workspace.");

  m.def(
      "_workspace_held_bytes",
      [](std::optional<mx::Stream> s) { return workspace::held_bytes(s); },
      "stream"_a = nb::none(),
      "Bytes of workspace held by one stream, or by all.");
}

} // namespace mlxq::prefill_bindings
