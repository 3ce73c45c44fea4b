// QuantizedSDPA: attention of float queries over K/V stored as MLX affine
// quantized triples, without dequantizing K or V to memory.
#pragma once

#include <optional>
#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "sdpa_codes.h"

namespace mlxq {

namespace mx = mlx::core;

struct QuantizedSDPAParams {
  float scale;
  // Keys and values are quantized independently (e.g. 8-bit keys with
  // 4-bit values).
  int k_group_size;
  int k_bits;
  int v_group_size;
  int v_bits;
  MaskCode mask; // sdpa_codes.h
  bool has_sinks;
  // A second output: each row's log-sum-exp of its scaled scores (natural
  // log, sinks included), so attention over a segment of the keys can be
  // merged with attention over the rest (quantized_sdpa's return_lse).
  bool with_lse = false;
  // CUDA only: rows of an exact window of recent keys and values among the
  // inputs, attended with the quantized ones (quantized_sdpa's recent_keys;
  // the CPU composes RecentAttention instead), causal over the window with
  // recent_causal.
  int recent = 0;
  bool recent_causal = false;
  // Attend only rows [0, rows) of the K/V inputs (-1: all of them): a
  // cache hands over its whole buffers, and the kernels take views of
  // those rows at eval (detail::with_prefix_rows), where a fetch of views
  // would add six outputs to the cache's write.
  int rows = -1;

  bool operator==(const QuantizedSDPAParams&) const = default;
};

/**
 * Inputs, in order:
 *   q [B, Hq, L, Dk] (f32/f16/bf16),
 *   k_packed, k_scales, k_biases, v_packed, v_scales, v_biases
 *     (mx.quantize triples of [B, Hkv, N, Dk] and [B, Hkv, N, Dv]),
 *   mask broadcast to [B, Hq, L, N] (bool or float) when mask == Array,
 *   sinks [Hq] float32 when has_sinks,
 *   recent keys [B, Hkv, recent, Dk] and values [B, Hkv, recent, Dv] (q's
 *     dtype) when params.recent > 0.
 * Outputs: [B, Hq, L, Dv] in q's dtype; with params.with_lse also the
 * rows' log-sum-exp [B, Hq, L] float32 (-inf for a row that sees no key and
 * no sink).
 */
class QuantizedSDPA : public mx::Primitive {
 public:
  QuantizedSDPA(mx::Stream stream, QuantizedSDPAParams params)
      : mx::Primitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QuantizedSDPA";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const QuantizedSDPAParams& params() const {
    return params_;
  }

 private:
  QuantizedSDPAParams params_;
};

/**
 * Validates every input, then builds the QuantizedSDPA node.
 * `mask_mode` is "" or "causal"; `mask` is an optional bool/additive array
 * broadcastable to [B, Hq, L, N] (not both). `group_size`/`bits` are the
 * keys' quantization, inferred from the shapes when not given;
 * `v_group_size` and `v_bits` default to the keys' (the value head dim is
 * unknown until the width is fixed, and a group size inferred from it could
 * silently fit a wrong width). Returns {out}, or with `return_lse`
 * {out, lse}: each row's log-sum-exp [B, Hq, L] (float32, natural log of the
 * softmax denominator, sinks included), so two attentions over disjoint key
 * sets merge exactly by their weights exp(lse_i - logaddexp(lse_1, lse_2));
 * every backend writes it (Metal: the decode kernel and its merge).
 * `recent_keys` / `recent_values` ([B, H_kv, T, D], q's dtype) are an exact
 * window of T more keys: the output is attention over both sets, the
 * window's rows after the quantized ones, all of them seen by every query
 * or, with `recent_causal` (T >= L), query l seeing window rows j <= l + T
 * - L; sinks count once. On CUDA one node (the decode kernel attends the
 * window in extra blocks of its split merge); on the CPU the quantized part
 * with its log-sum-exp, then RecentAttention. Not with `return_lse`.
 * Raises std::invalid_argument (ValueError in Python) naming the offending
 * input.
 */
std::vector<mx::array> quantized_sdpa(
    const mx::array& q,
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    float scale,
    const std::string& mask_mode = "",
    const std::optional<mx::array>& mask = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    std::optional<int> group_size = std::nullopt,
    std::optional<int> bits = std::nullopt,
    std::optional<int> v_group_size = std::nullopt,
    std::optional<int> v_bits = std::nullopt,
    bool return_lse = false,
    const std::optional<mx::array>& recent_keys = std::nullopt,
    const std::optional<mx::array>& recent_values = std::nullopt,
    bool recent_causal = false,
    std::optional<int> rows = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace mlxq
