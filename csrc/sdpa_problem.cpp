#include "sdpa_problem.h"

namespace mlxq {

namespace {

void copy4(const mx::array& a, int64_t (&dst)[4]) {
  for (int d = 0; d < 4; ++d) {
    dst[d] = a.strides()[d];
  }
}

} // namespace

DtypeCode dtype_code(mx::Dtype dtype) {
  switch (dtype) {
    case mx::float16:
      return kF16;
    case mx::bfloat16:
      return kBF16;
    case mx::bool_:
      return kBool;
    default:
      return kF32;
  }
}

SdpaProblem SdpaProblem::from(
    const std::vector<mx::array>& in,
    const QuantizedSDPAParams& params,
    const mx::array& out) {
  SdpaProblem p;
  const auto& q = in[kInQ];
  p.B = q.shape(0);
  p.Hq = q.shape(1);
  p.L = q.shape(2);
  p.Dk = q.shape(3);
  p.Hkv = in[kInKPacked].shape(1);
  p.N = in[kInKPacked].shape(2);
  p.Dv = out.shape(3);
  p.rep = p.Hq / p.Hkv;
  p.k_bits = params.k_bits;
  p.k_group_size = params.k_group_size;
  p.v_bits = params.v_bits;
  p.v_group_size = params.v_group_size;
  p.scale = params.scale;
  p.q_dtype = dtype_code(q.dtype());
  p.scale_dtype = dtype_code(in[kInKScales].dtype());
  p.mask = params.mask;
  p.has_sinks = params.has_sinks;
  p.with_lse = params.with_lse;
  copy4(q, p.q_st);
  for (int i = 0; i < 6; ++i) {
    copy4(in[kInKPacked + i], p.kv_st[i]);
  }
  int next = kInVBiases + 1;
  if (p.mask == kMaskArray) {
    p.mask_input = next++;
    p.mask_dtype = dtype_code(in[p.mask_input].dtype());
    copy4(in[p.mask_input], p.m_st);
  }
  if (p.has_sinks) {
    p.sinks_input = next++;
    p.sinks_stride = in[p.sinks_input].strides()[0];
  }
  if (params.recent > 0) {
    p.recent = params.recent;
    p.recent_causal = params.recent_causal;
    p.recent_input = next;
    copy4(in[next], p.rk_st);
    copy4(in[next + 1], p.rv_st);
  }
  return p;
}

} // namespace mlxq
