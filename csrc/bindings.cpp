// Python bindings of mlxq's primitives (module mlxq._ext). The thin Python
// layer in python/mlxq wraps these; the `mx.array`, `mx.Stream` and
// `mx.Device` types come from mlx.core through the shared "mlx" nanobind domain.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "cpu/int_dot.h"
#include "cuda/sdpa/plan_bindings.h"
#include "debug.h"
#include "dequantize_into.h"
#include "environment.h"
#include "metal/dispatch_bindings.h"
#include "prefill_bindings.h"
#include "quantization.h"
#include "quantized_sdpa.h"
#include "recent_attention.h"
#include "ring_update.h"
#include "translate_errors.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;
using mlxq::bindings::guarded;
using mlxq::bindings::translate_errors;

NB_MODULE(_ext, m) {
  m.doc() = "mlxq's C++ primitives (use the mlxq package, not this module).";
  m.attr("mlx_version") = MQ_MLX_VERSION;
  nb::list bits, group_sizes;
  for (int b : mlxq::kSupportedBits) {
    bits.append(b);
  }
  for (int g : mlxq::kSupportedGroupSizes) {
    group_sizes.append(g);
  }
  m.attr("SUPPORTED_BITS") = nb::tuple(bits);
  m.attr("SUPPORTED_GROUP_SIZES") = nb::tuple(group_sizes);

  // The fused attention: its output, or with return_lse (output, lse).
  m.def(
      "quantized_sdpa",
      guarded(
          +[](const mx::array& q,
              const mx::array& k_packed,
              const mx::array& k_scales,
              const mx::array& k_biases,
              const mx::array& v_packed,
              const mx::array& v_scales,
              const mx::array& v_biases,
              float scale,
              const std::string& mask_mode,
              const std::optional<mx::array>& mask,
              const std::optional<mx::array>& sinks,
              std::optional<int> group_size,
              std::optional<int> bits,
              std::optional<int> v_group_size,
              std::optional<int> v_bits,
              bool return_lse,
              const std::optional<mx::array>& recent_keys,
              const std::optional<mx::array>& recent_values,
              bool recent_causal,
              std::optional<int> rows,
              mx::StreamOrDevice s) -> nb::object {
            auto outs = mlxq::quantized_sdpa(
                q,
                k_packed,
                k_scales,
                k_biases,
                v_packed,
                v_scales,
                v_biases,
                scale,
                mask_mode,
                mask,
                sinks,
                group_size,
                bits,
                v_group_size,
                v_bits,
                return_lse,
                recent_keys,
                recent_values,
                recent_causal,
                rows,
                s);
            if (!return_lse) {
              return nb::cast(outs[0]);
            }
            return nb::make_tuple(outs[0], outs[1]);
          }),
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
      "group_size"_a = nb::none(),
      "bits"_a = nb::none(),
      "v_group_size"_a = nb::none(),
      "v_bits"_a = nb::none(),
      "return_lse"_a = false,
      "recent_keys"_a = nb::none(),
      "recent_values"_a = nb::none(),
      "recent_causal"_a = false,
      "rows"_a = nb::none(),
      "stream"_a = nb::none(),
      "Fused attention over MLX affine-quantized K/V (see mlxq.quantized_sdpa).");

  m.def(
      "recent_attention",
      guarded(&mlxq::recent_attention),
      "q"_a,
      "keys"_a,
      "values"_a,
      "out_q"_a,
      "lse_q"_a,
      nb::kw_only(),
      "scale"_a,
      "causal"_a = false,
      "mask"_a = nb::none(),
      "stream"_a = nb::none(),
      "Attention over an exact window (all of it, causally, or as a mask array says), merged with attention over other "
      "keys from its output and log-sum-exp (see mlxq.attention.recent_attention).");

  m.def(
      "ring_update",
      guarded(&mlxq::ring_update),
      "buffer"_a,
      "update"_a,
      "pos"_a,
      nb::kw_only(),
      "owned"_a = false,
      "stream"_a = nb::none(),
      "Write update rows into a ring buffer at pos (see mlxq.ring_update).");

  m.def(
      "window_step",
      [](const mx::array& keys_ring,
         const mx::array& values_ring,
         const mx::array& keys,
         const mx::array& values,
         int start,
         int span,
         int pos,
         mx::StreamOrDevice s) {
        auto out = translate_errors([&] {
          return mlxq::window_step(keys_ring, values_ring, keys, values, start, span, pos, s);
        });
        return nb::make_tuple(out[0], out[1], out[2], out[3]);
      },
      "keys_ring"_a,
      "values_ring"_a,
      "keys"_a,
      "values"_a,
      nb::kw_only(),
      "start"_a,
      "span"_a,
      "pos"_a,
      "stream"_a = nb::none(),
      "A recent window's many-row step: the exact rows (the rings' span, then keys / values) "
      "and the rings with the step's last rows written at pos (see mlxq.cache.recent).");

  m.def(
      "quantized_ring_update",
      [](const mx::array& packed,
         const mx::array& scales,
         const mx::array& biases,
         const mx::array& update,
         const mlxq::Position& pos,
         int group_size,
         int bits,
         bool owned,
         mx::StreamOrDevice s) {
        auto out = translate_errors([&] {
          return mlxq::quantized_ring_update(
              packed, scales, biases, update, pos, group_size, bits, owned, s);
        });
        return nb::make_tuple(out[0], out[1], out[2]);
      },
      "packed"_a,
      "scales"_a,
      "biases"_a,
      "update"_a,
      "pos"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "owned"_a = false,
      "stream"_a = nb::none(),
      "Quantize update rows into a quantized ring buffer (see mlxq.quantized_ring_update).");

  m.def(
      "quantized_kv_update",
      [](const mx::array& kp,
         const mx::array& ks,
         const mx::array& kb,
         const mx::array& vp,
         const mx::array& vs,
         const mx::array& vb,
         const mx::array& k_update,
         const mx::array& v_update,
         const mlxq::Position& pos,
         int group_size,
         int bits,
         int fetch,
         std::optional<int> v_group_size,
         std::optional<int> v_bits,
         std::optional<mx::array> recent_keys,
         std::optional<mx::array> recent_values,
         std::optional<mx::array> recent_key_rows,
         std::optional<mx::array> recent_value_rows,
         bool recent_owned,
         std::optional<mlxq::Position> recent_pos,
         mx::StreamOrDevice s) {
        auto out = translate_errors([&] {
          std::optional<mlxq::RecentWrite> window;
          if (recent_keys || recent_values) {
            if (!recent_keys || !recent_values) {
              throw std::invalid_argument(
                  "[mlxq.quantized_kv_update] pass recent_keys and recent_values together.");
            }
            window = mlxq::RecentWrite{
                *recent_keys,
                *recent_values,
                recent_key_rows.value_or(k_update),
                recent_value_rows.value_or(v_update),
                recent_owned,
                recent_pos};
          } else if (recent_key_rows || recent_value_rows || recent_pos) {
            throw std::invalid_argument(
                "[mlxq.quantized_kv_update] recent rows need the rings they go to "
                "(recent_keys, recent_values).");
          }
          return mlxq::quantized_kv_update(
              {kp, ks, kb},
              {vp, vs, vb},
              k_update,
              v_update,
              pos,
              group_size,
              bits,
              fetch,
              v_group_size,
              v_bits,
              window,
              s);
        });
        nb::list parts;
        parts.append(nb::make_tuple(out[0], out[1], out[2]));
        parts.append(nb::make_tuple(out[3], out[4], out[5]));
        size_t i = 6;
        if (fetch >= 0) {
          // Also the caches' fetch, rows [0, fetch) of every array, as views
          // that the same primitive outputs: six Python slices cost more
          // than the write itself.
          parts.append(nb::make_tuple(out[6], out[7], out[8]));
          parts.append(nb::make_tuple(out[9], out[10], out[11]));
          i = 12;
        }
        for (; i < out.size(); ++i) { // the recent rings
          parts.append(out[i]);
        }
        return nb::tuple(parts);
      },
      "k_packed"_a,
      "k_scales"_a,
      "k_biases"_a,
      "v_packed"_a,
      "v_scales"_a,
      "v_biases"_a,
      "k_update"_a,
      "v_update"_a,
      "pos"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "fetch"_a = -1,
      "v_group_size"_a = nb::none(),
      "v_bits"_a = nb::none(),
      "recent_keys"_a = nb::none(),
      "recent_values"_a = nb::none(),
      "recent_key_rows"_a = nb::none(),
      "recent_value_rows"_a = nb::none(),
      "recent_owned"_a = false,
      "recent_pos"_a = nb::none(),
      "stream"_a = nb::none(),
      "A KV cache's write of one step: quantize K and V rows into both triples in place "
      "(fetch >= 0: also return their rows [0, fetch) as views; recent_keys / recent_values: "
      "also write the rows (recent_key_rows / recent_value_rows, default the updates) into an "
      "exact window's two rings at the same position, or at recent_pos, and return them last).");

  m.def(
      "dequantize_into",
      [](const mx::array& workspace,
         const mx::array& packed,
         const mx::array& scales,
         const mx::array& biases,
         int group_size,
         int bits,
         const std::vector<mx::array>& after,
         mx::StreamOrDevice s) {
        return translate_errors([&] {
          return mlxq::dequantize_into(
              workspace, packed, scales, biases, group_size, bits, after, s);
        });
      },
      "workspace"_a,
      "packed"_a,
      "scales"_a,
      "biases"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "after"_a = std::vector<mx::array>{},
      "stream"_a = nb::none(),
      "Dequantize a triple into the workspace's memory, after the arrays in `after` "
      "(see mlxq.workspace).");

  m.def(
      "_take_workspace_misses",
      &mlxq::detail::take_workspace_misses,
      "Test hook: dequantize_into calls that could not use their workspace (then resets).");

  m.def(
      "_take_ring_copies",
      &mlxq::detail::take_ring_copies,
      "Test hook: ring/KV writes that copied their buffer since the last call (then resets).");

  m.def(
      "_install_crash_backtrace",
      &mlxq::install_crash_backtrace,
      "Debug hook: print a native backtrace on SIGSEGV/SIGABRT.");

  m.def(
      "_take_last_sdpa_kernel",
      [] { return std::string(mlxq::take_last_sdpa_kernel()); },
      "Test hook: the kernel family the last sdpa evaluation chose (CUDA: decode, tiled, ...; "
      "CPU: cpu_int16 or cpu_f32 products), then clears it.");

  m.def(
      "_cpu_int_kernels",
      []() -> std::optional<std::string> {
        const auto* k = mlxq::cpu::int_dot();
        return k ? std::optional<std::string>(k->name) : std::nullopt;
      },
      "Test hook: the CPU kernel's integer products in use now (avx512-vnni, avx512-bw, "
      "avx2; MLXQ_CPU_INT=0, avx2 or avx512-bw chooses), or None: f32 products.");

  m.def(
      "_environment",
      [] {
        nb::dict d;
        for (const auto& [name, value] : mlxq::environment_items()) {
          d[name.c_str()] = value;
        }
        return d;
      },
      "The MLXQ_* variables mlxq reads (csrc/environment.cpp), as parsed: switches as "
      "'1' (on) or '0' (off).");

  m.def(
      "_set_environment",
      guarded(+[](const std::string& name, const std::string& value) {
        mlxq::set_environment(name, value);
      }),
      "name"_a,
      "value"_a,
      "Test hook: parse `value` for one MLXQ_* variable as if it had been set at start "
      "(MLXQ_NUM_THREADS and MLXQ_CUDA_POOL take effect only before first use).");

  m.def(
      "_set_tuning",
      guarded(+[](const std::string& name, int64_t value) { mlxq::set_tuning(name, value); }),
      "name"_a,
      "value"_a,
      "Test hook: override one of the plans' measured block shapes or thresholds "
      "(cuda_tiled_warps, cuda_tiled_keys, cuda_gemm_min_keys, cuda_gemm_block_elements, "
      "split_tasks_per_thread; 0 leaves the choice to the plan).");

  m.def(
      "_scheduled",
      [](const mx::array& a) { return a.status() != mx::array::Status::unscheduled; },
      "a"_a,
      "Whether an evaluation (eval or async_eval) has taken the array: its graph is then "
      "ordered before anything built after it on the same stream.");

  m.def(
      "_device_memory",
      [] { return nb::make_tuple(mlxq::device_bytes_active(), mlxq::take_device_bytes_peak()); },
      "(active, peak) bytes of mlxq's own GPU pool (CUDA outputs and scratch; MLX's "
      "get_peak_memory does not see them); the peak then restarts from active.");

  m.def(
      "_set_poison_outputs",
      &mlxq::set_poison_outputs,
      "enabled"_a,
      "Test hook: fill every new mlxq output with NaN/0xFF before its kernel runs.");

  mlxq::prefill_bindings::add(m);
  mlxq::metal_dispatch::add_plan_bindings(m);
  mlxq::cuda::add_plan_bindings(m);
}
