// Instances of the tensor-core tiled kernel for bf16 queries, and the
// dispatcher over query dtypes.
#include "cuda/quantized_sdpa_prefill.cuh"

namespace mlxq::cuda {

TcKernel sdpa_tc_kernel(int q_dtype, int D, int gs, int warps, int keys) {
  if (gs != 32 && gs != 64 && gs != 128) {
    return {};
  }
  switch (q_dtype) {
    case kF16:
      return sdpa_tc_kernel_f16(D, gs, warps, keys);
    case kBF16:
      return for_dim<__nv_bfloat16>(D, gs, warps, keys);
    default:
      return {};
  }
}

} // namespace mlxq::cuda
