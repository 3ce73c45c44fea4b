// Small helpers shared by mlxq's Metal kernels: float storage types, loads
// of a runtime-typed float array, the output normaliser, instantiation macro.
#pragma once

#include <metal_stdlib>

#include "mlxq_params.h"

using namespace metal;

// bfloat16 is MSL 3.1's native bfloat, as in MLX 0.32's own kernels (which
// require macOS 14 / MSL 3.1, the metallib's deployment target): every
// conversion rounds exactly as MLX's kernels round on the same GPU, NaN and
// signed zero included.
typedef bfloat mlxq_bfloat16;

// Query row r of a KV head's rows (its rep query heads x the positions, head
// fastest): its position and its query head.
METAL_FUNC int mlxq_row_position(int r, int rep) {
  return r / rep;
}
METAL_FUNC int mlxq_row_head(int kvh, int r, int rep) {
  return kvh * rep + r % rep;
}

METAL_FUNC float mlxq_to_float(float x) {
  return x;
}
METAL_FUNC float mlxq_to_float(half x) {
  return float(x);
}
METAL_FUNC float mlxq_to_float(bfloat x) {
  return float(x);
}

template <typename T>
METAL_FUNC T mlxq_from_float(float x);

template <>
METAL_FUNC float mlxq_from_float<float>(float x) {
  return x;
}
template <>
METAL_FUNC half mlxq_from_float<half>(float x) {
  return half(x);
}
template <>
METAL_FUNC bfloat mlxq_from_float<bfloat>(float x) {
  return bfloat(x);
}

// Element idx of a float array whose dtype (MQ_DT_*) is known at run time.
METAL_FUNC float mlxq_load(const device uchar* base, mlxq_i64 idx, int dt) {
  if (dt == MQ_DT_F32) {
    return ((const device float*)base)[idx];
  }
  if (dt == MQ_DT_F16) {
    return float(((const device half*)base)[idx]);
  }
  return as_type<float>(uint(((const device ushort*)base)[idx]) << 16);
}

// Softmax normaliser of one row from its running max m and sum l over keys
// and the optional sink logit: the factor its unnormalised output is
// multiplied by. A row that sees no key and no sink mass gets 0.
METAL_FUNC float mlxq_inverse_denominator(float m, float l, bool has_sink, float sink) {
  if (has_sink) {
    const float mm = max(m, sink);
    if (mm == -INFINITY) {
      return 0.0f;
    }
    const float carried = m == -INFINITY ? 0.0f : exp(m - mm);
    const float denom = l * carried + exp(sink - mm);
    return denom > 0.0f ? carried / denom : 0.0f;
  }
  return l > 0.0f ? 1.0f / l : 0.0f;
}

// The natural log of a row's softmax denominator from its running max m
// (natural units), sum l and optional sink logit: the row's log-sum-exp
// (quantized_sdpa_with_lse); -inf for a row that saw nothing.
METAL_FUNC float mlxq_log_denominator(float m, float l, bool has_sink, float sink) {
  if (has_sink) {
    const float mm = max(m, sink);
    if (mm == -INFINITY) {
      return -INFINITY;
    }
    const float carried = m == -INFINITY ? 0.0f : l * exp(m - mm);
    return mm + log(carried + exp(sink - mm));
  }
  return (m == -INFINITY || !(l > 0.0f)) ? -INFINITY : m + log(l);
}

#define MQ_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
