// Python bindings of mlxq's primitives (module mlxq._ext). The thin Python
// layer in python/mlxq wraps these; the `mx.array`, `mx.Stream` and
// `mx.Device` types come from mlx.core through the shared "mlx" nanobind domain.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "debug.h"
#include "quantized_sdpa.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxq's C++ primitives (use the mlxq package, not this module).";
  m.attr("mlx_version") = MLXQ_MLX_VERSION;

  m.def(
      "quantized_sdpa",
      &mlxq::quantized_sdpa,
      "q"_a,
      "k_packed"_a,
      "k_scales"_a,
      "k_biases"_a,
      "v_packed"_a,
      "v_scales"_a,
      "v_biases"_a,
      nb::kw_only(),
      "scale"_a,
      "mask_mode"_a = "",
      "mask"_a = nb::none(),
      "sinks"_a = nb::none(),
      "bits"_a = nb::none(),
      "group_size"_a = nb::none(),
      "stream"_a = nb::none(),
      "Fused attention over MLX affine-quantized K/V (see mlxq.quantized_sdpa).");

  m.def(
      "_set_poison_outputs",
      &mlxq::set_poison_outputs,
      "enabled"_a,
      "Test hook: fill every new mlxq output with NaN/0xFF before its kernel runs.");
}
