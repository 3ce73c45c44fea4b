#include "recent_attention.h"

#include "mlx/backend/metal/metal.h"

#include "validation.h"

namespace mlxq {

namespace {

constexpr const char* kOp = "mlxq.recent_attention";

void check_4d(const mx::array& a, const char* name) {
  if (a.ndim() != 4) {
    fail(kOp, name, " must be 4-D, got shape ", shape_str(a.shape()), ".");
  }
}

} // namespace

void check_recent_rows(
    const char* op,
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    bool causal,
    const char* keys_name,
    const char* values_name) {
  for (auto [a, name] : {std::pair{&q, "q"}, {&keys, keys_name}, {&values, values_name}}) {
    if (a->ndim() != 4) {
      fail(op, name, " must be 4-D, got shape ", shape_str(a->shape()), ".");
    }
  }
  if (!is_float_dtype(q.dtype())) {
    fail(op, "q must be float32, float16 or bfloat16, got ", dtype_str(q.dtype()), ".");
  }
  if (keys.dtype() != q.dtype() || values.dtype() != q.dtype()) {
    fail(
        op,
        keys_name,
        " and ",
        values_name,
        " must have q's dtype ",
        dtype_str(q.dtype()),
        ", got ",
        dtype_str(keys.dtype()),
        " and ",
        dtype_str(values.dtype()),
        ".");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Dk = q.shape(3);
  const int Hkv = keys.shape(1), T = keys.shape(2), Dv = values.shape(3);
  if (keys.shape(0) != B || keys.shape(3) != Dk || values.shape(0) != B || values.shape(1) != Hkv ||
      values.shape(2) != T) {
    fail(
        op,
        keys_name,
        " [B, Hkv, T, Dk] and ",
        values_name,
        " [B, Hkv, T, Dv] do not fit q ",
        shape_str(q.shape()),
        ": got ",
        shape_str(keys.shape()),
        " and ",
        shape_str(values.shape()),
        ".");
  }
  if (Hkv < 1 || Hq % Hkv != 0) {
    fail(op, "q's ", Hq, " heads are not a multiple of the ", keys_name, "' ", Hkv, ".");
  }
  if (T < 1) {
    fail(op, "the window must hold at least one key, got T = ", T, ".");
  }
  if (causal && T < L) {
    fail(op, "a causal window must hold the step's ", L, " query positions, got T = ", T, ".");
  }
  if (Dk < 1 || Dv < 1 || Dk > kWindowMaxHeadDim || Dv > kWindowMaxHeadDim) {
    fail(op, "head dims must lie in [1, ", kWindowMaxHeadDim, "], got ", Dk, " and ", Dv, ".");
  }
}

mx::array recent_attention(
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& out_q,
    const mx::array& lse_q,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  check_recent_rows(kOp, q, keys, values, causal, "keys", "values");
  check_4d(out_q, "out_q");
  if (out_q.dtype() != q.dtype()) {
    fail(
        kOp,
        "out_q must have q's dtype ",
        dtype_str(q.dtype()),
        ", got ",
        dtype_str(out_q.dtype()),
        ".");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Dv = values.shape(3);
  const mx::Shape out_shape{B, Hq, L, Dv};
  if (out_q.shape() != out_shape) {
    fail(
        kOp,
        "out_q must be ",
        shape_str(out_shape),
        " (q's rows, the values' dim), got ",
        shape_str(out_q.shape()),
        ".");
  }
  if (lse_q.dtype() != mx::float32 || lse_q.shape() != mx::Shape{B, Hq, L}) {
    fail(
        kOp,
        "lse_q must be float32 ",
        shape_str(mx::Shape{B, Hq, L}),
        ", got ",
        dtype_str(lse_q.dtype()),
        " ",
        shape_str(lse_q.shape()),
        ".");
  }
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu && mx::metal::is_available()) {
    fail(kOp, "runs on the CPU and CUDA, not yet on Metal; pass stream=mx.cpu.");
  }
  std::vector<mx::array> inputs = {q, keys, values, out_q, lse_q};
  if (mask) {
    if (causal) {
      fail(kOp, "pass either causal=True or a mask array, not both.");
    }
    if (stream.device != mx::Device::cpu) {
      fail(
          kOp,
          "takes a mask array on the CPU only; on a GPU attend the window with "
          "mlxq.attention.dense_attention_with_lse and merge_attention.");
    }
    // A broadcast view: the kernel reads it through its (zero) strides.
    const mx::Shape target = {B, Hq, L, keys.shape(2)};
    check_mask_array(kOp, *mask, target, "[B, H_q, L, T]");
    inputs.push_back(mx::broadcast_to(*mask, target, s));
  }
  return mx::array(
      out_shape, q.dtype(), std::make_shared<RecentAttention>(stream, scale, causal), inputs);
}

} // namespace mlxq
