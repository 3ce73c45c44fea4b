#include "quantized_sdpa.h"

#include <cmath>

#include "mlx/backend/metal/metal.h"

#include "prefill_route.h"
#include "prefill_workspace.h"
#include "prefix_view.h"
#include "quantization.h"
#include "recent_attention.h"
#include "validation.h"

namespace mlxq {

namespace {

constexpr const char* kOp = "mlxq.quantized_sdpa";

struct Triple {
  const char* name;
  const mx::array& packed;
  const mx::array& scales;
  const mx::array& biases;
};

// Checks one (packed, scales, biases) triple on its own and returns its
// (elements per row, groups per row).
void check_triple(const Triple& t) {
  for (auto [part, a] :
       {std::pair<const char*, const mx::array*>{"packed", &t.packed},
        {"scales", &t.scales},
        {"biases", &t.biases}}) {
    if (a->ndim() != 4) {
      fail(
          kOp,
          t.name,
          " ",
          part,
          " must be 4-D [B, H_kv, N, ...], got shape ",
          shape_str(a->shape()),
          ".");
    }
  }
  if (t.packed.dtype() != mx::uint32) {
    fail(
        kOp,
        t.name,
        " packed must be uint32 (as mx.quantize returns), got ",
        dtype_str(t.packed.dtype()),
        ".");
  }
  if (!is_float_dtype(t.scales.dtype())) {
    fail(
        kOp,
        t.name,
        " scales must be float32, float16 or bfloat16, got ",
        dtype_str(t.scales.dtype()),
        ".");
  }
  if (t.biases.dtype() != t.scales.dtype()) {
    fail(
        kOp,
        t.name,
        " biases dtype ",
        dtype_str(t.biases.dtype()),
        " does not match its scales dtype ",
        dtype_str(t.scales.dtype()),
        ".");
  }
  if (t.scales.shape() != t.biases.shape()) {
    fail(
        kOp,
        t.name,
        " scales shape ",
        shape_str(t.scales.shape()),
        " does not match its biases shape ",
        shape_str(t.biases.shape()),
        ".");
  }
  for (int d = 0; d < 3; ++d) {
    if (t.packed.shape(d) != t.scales.shape(d)) {
      fail(
          kOp,
          t.name,
          " packed shape ",
          shape_str(t.packed.shape()),
          " and scales shape ",
          shape_str(t.scales.shape()),
          " disagree on [B, H_kv, N].");
    }
  }
}

// Infers (group_size, bits) of a triple whose rows hold `dim` elements, or
// checks the given ones (named `prefix`group_size / `prefix`bits in errors).
std::pair<int, int> infer_quantization(
    const Triple& t,
    int dim,
    std::optional<int> group_size,
    std::optional<int> bits,
    const char* prefix) {
  int words = t.packed.shape(3);
  int groups = t.scales.shape(3);
  if (dim <= 0 || words <= 0 || groups <= 0) {
    fail(
        kOp,
        t.name,
        " has an empty head dimension (packed ",
        shape_str(t.packed.shape()),
        ", scales ",
        shape_str(t.scales.shape()),
        ").");
  }
  int b = bits.value_or((words * 32) / dim);
  int g = group_size.value_or(dim / groups);
  if (!is_supported_bits(b)) {
    fail(
        kOp,
        prefix,
        "bits must be ",
        supported_bits_text(),
        ", got ",
        b,
        bits ? "." : " (inferred from the packed width).");
  }
  if (!is_supported_group_size(g)) {
    fail(
        kOp,
        prefix,
        "group_size must be ",
        supported_group_sizes_text(),
        ", got ",
        g,
        group_size ? "." : " (inferred from the scales width).");
  }
  if (words * 32 != dim * b) {
    fail(
        kOp,
        t.name,
        " packed width ",
        words,
        " does not hold ",
        dim,
        " values of ",
        b,
        " bits (expected ",
        (dim * b) / 32.0,
        ").");
  }
  if (groups * g != dim) {
    fail(
        kOp,
        t.name,
        " scales width ",
        groups,
        " does not match ",
        dim,
        " values in groups of ",
        g,
        ".");
  }
  return {g, b};
}

} // namespace

std::vector<mx::array> quantized_sdpa(
    const mx::array& q,
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
    mx::StreamOrDevice s) {
  if (q.ndim() != 4) {
    fail(kOp, "queries must be 4-D [B, H_q, L, D], got shape ", shape_str(q.shape()), ".");
  }
  if (!is_float_dtype(q.dtype())) {
    fail(kOp, "queries must be float32, float16 or bfloat16, got ", dtype_str(q.dtype()), ".");
  }
  Triple kt{"keys", k_packed, k_scales, k_biases};
  Triple vt{"values", v_packed, v_scales, v_biases};
  check_triple(kt);
  check_triple(vt);
  if (k_scales.dtype() != v_scales.dtype()) {
    fail(
        kOp,
        "keys and values must be quantized with the same scales dtype, got ",
        dtype_str(k_scales.dtype()),
        " and ",
        dtype_str(v_scales.dtype()),
        ".");
  }
  for (int d = 0; d < 3; ++d) {
    if (k_packed.shape(d) != v_packed.shape(d)) {
      fail(
          kOp,
          "keys ",
          shape_str(k_packed.shape()),
          " and values ",
          shape_str(v_packed.shape()),
          " disagree on [B, H_kv, N].");
    }
  }
  int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Dk = q.shape(3);
  int Hkv = k_packed.shape(1), N = k_packed.shape(2);
  if (rows && (*rows < 0 || *rows > N)) {
    fail(kOp, "rows must lie in [0, ", N, "] (the K/V buffers' rows), got ", *rows, ".");
  }
  // A prefill-sized step may be routed through MLX's attention over its
  // dequantized rows, which reads whole arrays: those get slices (a decode
  // step's kernels take views at eval instead).
  auto over_rows = [&]() {
    auto cut = [&](const mx::array& a) { return detail::row_range(a, 0, *rows, s); };
    return quantized_sdpa(
        q,
        cut(k_packed),
        cut(k_scales),
        cut(k_biases),
        cut(v_packed),
        cut(v_scales),
        cut(v_biases),
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
        std::nullopt,
        s);
  };
  const bool recent = recent_keys || recent_values;
  auto stream = mx::to_stream(s);
  // A recent window's prefill step on a GPU keeps its whole buffers: routed,
  // their rows after `rows` are where its exact rows go (ExactRows).
  const bool exact_route = recent && L > 8 && !return_lse && stream.device == mx::Device::gpu;
  if (rows && *rows < N && L > 8 && !exact_route) {
    return over_rows();
  }
  const bool prefix = rows && *rows < N;
  if (prefix) {
    N = *rows;
  }
  if (k_packed.shape(0) != B) {
    fail(kOp, "queries batch ", B, " does not match the keys batch ", k_packed.shape(0), ".");
  }
  if (Hkv < 1 || Hq % Hkv != 0) {
    fail(
        kOp,
        "the number of query heads (",
        Hq,
        ") must be a multiple of the number of KV heads (",
        Hkv,
        ").");
  }
  if (Dk > kMaxHeadDim) {
    fail(kOp, "query head dimension ", Dk, " exceeds the maximum ", kMaxHeadDim, ".");
  }
  auto [kg, kb] = infer_quantization(kt, Dk, group_size, bits, "");
  const int vbits = v_bits.value_or(kb);
  if (!is_supported_bits(vbits)) {
    fail(kOp, "v_bits must be ", supported_bits_text(), ", got ", vbits, ".");
  }
  int Dv = (v_packed.shape(3) * 32) / vbits;
  auto [vg, vb] = infer_quantization(vt, Dv, v_group_size.value_or(kg), vbits, "v_");
  if (Dv > kMaxHeadDim) {
    fail(kOp, "value head dimension ", Dv, " exceeds the maximum ", kMaxHeadDim, ".");
  }
  if (!std::isfinite(scale)) {
    fail(kOp, "scale must be finite, got ", scale, ".");
  }

  QuantizedSDPAParams params{scale, kg, kb, vg, vb, kMaskNone, false};
  params.rows = prefix ? N : -1;
  std::vector<mx::array> inputs = {q, k_packed, k_scales, k_biases, v_packed, v_scales, v_biases};

  if (!mask_mode.empty() && mask_mode != "causal") {
    fail(kOp, "mask must be None, \"causal\" or an array, got \"", mask_mode, "\".");
  }
  if (mask_mode == "causal" && mask) {
    fail(kOp, "pass either mask=\"causal\" or a mask array, not both.");
  }
  if (mask_mode == "causal") {
    params.mask = kMaskCausal;
  } else if (mask) {
    const mx::Shape target = {B, Hq, L, N};
    check_mask_array(kOp, *mask, target, "[B, H_q, L, N]");
    params.mask = kMaskArray;
    // A broadcast view: the kernel reads it through its (zero) strides.
    inputs.push_back(mx::broadcast_to(*mask, target, s));
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != Hq) {
      fail(kOp, "sinks must have shape (H_q,) = (", Hq, ",), got ", shape_str(sinks->shape()), ".");
    }
    if (!is_float_dtype(sinks->dtype())) {
      fail(kOp, "sinks must be float32, float16 or bfloat16, got ", dtype_str(sinks->dtype()), ".");
    }
    params.has_sinks = true;
    // The kernels read sinks[h] directly: a strided or broadcast float32 view
    // (which astype passes through) must become a dense copy first.
    inputs.push_back(mx::contiguous(mx::astype(*sinks, mx::float32, s), false, s));
  }

  std::optional<mx::Dtype> sinks_dtype;
  if (sinks) {
    sinks_dtype = sinks->dtype();
  }
  if (recent) {
    if (!recent_keys || !recent_values) {
      fail(kOp, "pass recent_keys and recent_values together.");
    }
    if (return_lse) {
      fail(kOp, "return_lse is not available with recent rows; attend them apart and merge.");
    }
    check_recent_rows(
        kOp, q, *recent_keys, *recent_values, recent_causal, "recent_keys", "recent_values");
    if (recent_keys->shape(1) != Hkv || recent_values->shape(3) != Dv) {
      fail(
          kOp,
          "recent_keys ",
          shape_str(recent_keys->shape()),
          " and recent_values ",
          shape_str(recent_values->shape()),
          " must have the quantized rows' ",
          Hkv,
          " KV heads and value dim ",
          Dv,
          ".");
    }
    if (exact_route) {
      if (params.mask == kMaskNone) {
        const int T = recent_keys->shape(2);
        PrefillProblem p{
            L,
            N + T,
            Hq,
            Hkv,
            Dk,
            Dv,
            q.dtype(),
            k_scales.dtype(),
            recent_causal ? kMaskCausal : kMaskNone,
            sinks_dtype};
        auto routed = routed_prefill(
            q,
            k_packed,
            k_scales,
            k_biases,
            v_packed,
            v_scales,
            v_biases,
            p,
            scale,
            kg,
            kb,
            vg,
            vb,
            sinks,
            stream,
            ExactRows{*recent_keys, *recent_values, N});
        if (routed) {
          return {std::move(*routed)};
        }
      }
      if (prefix) {
        return over_rows();
      }
    }
    if (stream.device == mx::Device::cpu || mx::metal::is_available()) {
      // The quantized part with its log-sum-exp, then the window merged in.
      auto parts = quantized_sdpa(
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
          kg,
          kb,
          vg,
          vb,
          true,
          std::nullopt,
          std::nullopt,
          false,
          rows,
          s);
      return {recent_attention(
          q,
          *recent_keys,
          *recent_values,
          parts[0],
          parts[1],
          scale,
          recent_causal,
          std::nullopt,
          s)};
    }
  }
  if (!return_lse && !recent && L > 8) {
    PrefillProblem p{L, N, Hq, Hkv, Dk, Dv, q.dtype(), k_scales.dtype(), params.mask, sinks_dtype};
    auto routed = routed_prefill(
        q,
        k_packed,
        k_scales,
        k_biases,
        v_packed,
        v_scales,
        v_biases,
        p,
        scale,
        kg,
        kb,
        vg,
        vb,
        sinks,
        stream);
    if (routed) {
      return {std::move(*routed)};
    }
  } else if (!return_lse) { // decoding: this stream's prefill K/V buffers are not needed
    workspace::release(stream);
  }
  params.with_lse = return_lse;
  if (recent) {
    params.recent = recent_keys->shape(2);
    params.recent_causal = recent_causal;
    inputs.push_back(*recent_keys);
    inputs.push_back(*recent_values);
  }
  auto node = std::make_shared<QuantizedSDPA>(stream, params);
  if (!return_lse) {
    return {mx::array({B, Hq, L, Dv}, q.dtype(), std::move(node), std::move(inputs))};
  }
  return mx::array::make_arrays(
      {{B, Hq, L, Dv}, {B, Hq, L}}, {q.dtype(), mx::float32}, std::move(node), std::move(inputs));
}

bool QuantizedSDPA::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedSDPA&>(other);
  return params_ == o.params_;
}

std::vector<mx::Shape> QuantizedSDPA::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& q = inputs[0];
  int Dv = (inputs[4].shape(3) * 32) / params_.v_bits;
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), q.shape(2), Dv}};
  if (params_.with_lse) {
    shapes.push_back({q.shape(0), q.shape(1), q.shape(2)});
  }
  return shapes;
}

} // namespace mlxq
