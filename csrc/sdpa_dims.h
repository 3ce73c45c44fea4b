// The sizes every backend's attention arguments carry under the same names:
// SdpaProblem, CUDA's SdpaArgs, Metal's plan problem and MlxqSdpaParams.
// One helper copies them from one block to the next; each backend adds the
// fields it names its own way (query dtype, mask code, sinks). No MLX
// dependency, so every backend's host code can include it.
#pragma once

namespace mlxq {

// Batch, heads, lengths, head dims, K/V widths and group sizes, the scales'
// dtype code and the scale of `from` into `to`.
template <typename From, typename To>
void copy_dims(const From& from, To& to) {
  to.B = from.B;
  to.Hq = from.Hq;
  to.Hkv = from.Hkv;
  to.L = from.L;
  to.N = from.N;
  to.Dk = from.Dk;
  to.Dv = from.Dv;
  to.k_bits = from.k_bits;
  to.v_bits = from.v_bits;
  to.k_group_size = from.k_group_size;
  to.v_group_size = from.v_group_size;
  to.scale_dtype = from.scale_dtype;
  to.scale = from.scale;
}

} // namespace mlxq
