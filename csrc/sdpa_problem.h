// One QuantizedSDPA evaluation as the backends see it: shapes, element
// types, strides, mask and sinks, read from the primitive's inputs once
// (SdpaProblem::from). Each backend then plans from it and binds its own
// pointers (problem -> plan -> bind -> launch).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

#include "quantized_sdpa.h"
#include "sdpa_codes.h"

namespace mlxq {

namespace mx = mlx::core;

// QuantizedSDPA's inputs by position (mask and sinks follow when present).
enum SdpaInput : int {
  kInQ = 0,
  kInKPacked = 1,
  kInKScales = 2,
  kInKBiases = 3,
  kInVPacked = 4,
  kInVScales = 5,
  kInVBiases = 6,
};

DtypeCode dtype_code(mx::Dtype dtype);

struct SdpaProblem {
  int B = 0, Hq = 0, Hkv = 1, L = 0, N = 0, Dk = 0, Dv = 0;
  int rep = 1; // query heads per KV head
  int k_group_size = 64, k_bits = 4; // keys' quantization
  int v_group_size = 64, v_bits = 4; // values'
  bool same_quantization() const {
    return k_bits == v_bits && k_group_size == v_group_size;
  }
  float scale = 1.0f;
  DtypeCode q_dtype = kF32; // also the output's
  DtypeCode scale_dtype = kF32; // scales and biases of K and V
  MaskCode mask = kMaskNone;
  DtypeCode mask_dtype = kBool; // when mask == kMaskArray
  bool has_sinks = false;
  bool with_lse = false; // a second output: each row's log-sum-exp
  int mask_input = -1; // index in the inputs, or -1
  int sinks_input = -1;
  // An exact window of `recent` more keys (QuantizedSDPAParams::recent):
  // its keys' input index (the values' follows) and strides.
  int recent = 0;
  bool recent_causal = false;
  int recent_input = -1;
  int64_t rk_st[4] = {}, rv_st[4] = {};
  // Strides in elements: q, the six K/V arrays (SdpaInput order, from 1),
  // the mask (broadcast to [B, Hq, L, N]); sinks [Hq].
  int64_t q_st[4] = {0, 0, 0, 1};
  int64_t kv_st[6][4] = {};
  int64_t m_st[4] = {};
  int64_t sinks_stride = 1;

  static SdpaProblem from(
      const std::vector<mx::array>& inputs,
      const QuantizedSDPAParams& params,
      const mx::array& out);

  // Query rows of one (batch, KV head): its query heads x positions.
  int rows() const {
    return rep * L;
  }
  bool empty() const {
    return B == 0 || Hq == 0 || L == 0;
  }
  // Row r of KV head `kv_head`: its query position and query head.
  int position(int r) const {
    return r / rep;
  }
  int query_head(int kv_head, int r) const {
    return kv_head * rep + r % rep;
  }
};

} // namespace mlxq
