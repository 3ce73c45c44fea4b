// A decode step's exact recent window, attended and merged with the
// quantized part's attention in one primitive (mlxq.cache.recent): the
// dozen MLX ops it replaces cost ~100-250 us of GPU eval per layer on an
// H200, this one launch a few.
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxq {

namespace mx = mlx::core;

/** Inputs: q [B, Hq, L, Dk], keys [B, Hkv, T, Dk], values [B, Hkv, T, Dv]
 *  (q's dtype), out_q [B, Hq, L, Dv] (q's dtype) and lse_q [B, Hq, L]
 *  (float32): attention over other keys and each row's log-sum-exp (-inf
 *  for a row that saw none), then optionally a mask [B, Hq, L, T] (a
 *  broadcast view; bool, or additive in a float dtype). Output [B, Hq, L,
 *  Dv] in q's dtype: attention over those keys and these T, in float32:
 *  softmax(scale q K^T + mask) V merged with out_q by log-sum-exp; a row
 *  that saw no key in either part gets zeros. Every query row sees every
 *  window row, or with `causal` (T >= L, the queries being the window's
 *  last L positions) query l sees rows j <= l + T - L, or the mask says
 *  which (the CPU only: a sliding-window layer's prefill chunk). */
class RecentAttention : public mx::UnaryPrimitive {
 public:
  RecentAttention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "RecentAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RecentAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[3].shape()};
  }
  float scale() const {
    return scale_;
  }
  bool causal() const {
    return causal_;
  }

 private:
  float scale_;
  bool causal_;
};

// The most head dims the window's kernels take (registers per lane on CUDA).
constexpr int kWindowMaxHeadDim = 512;

// Checks a window's rows against their queries (4-D, q's dtype, [B, Hkv,
// T, Dk] and [B, Hkv, T, Dv] with Hq a multiple of Hkv, T >= 1, T >= L when
// causal, head dims at most kWindowMaxHeadDim), naming them keys_name and
// values_name in the std::invalid_argument it throws.
void check_recent_rows(
    const char* op,
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    bool causal,
    const char* keys_name,
    const char* values_name);

mx::array recent_attention(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& out_q,
    const mx::array& lse_q,
    float scale,
    bool causal = false,
    const std::optional<mx::array>& mask = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace mlxq
