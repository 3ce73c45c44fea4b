// Instances of the tensor-core tiled kernel for bf16 queries, and the
// dispatcher over query dtypes.
#include "cuda/sdpa/tiled.cuh"

namespace mlxq::cuda {

TiledKernel tiled_kernel(int q_dtype, int D, int gs, int warps, int keys) {
  if (gs != 32 && gs != 64 && gs != 128) {
    return {};
  }
  switch (q_dtype) {
    case kF16:
      return tiled_kernel_f16(D, gs, warps, keys);
    case kBF16:
      return for_dim<__nv_bfloat16>(D, gs, warps, keys);
    default:
      return {};
  }
}

TiledKernel tiled_dense_kernel(int q_dtype, int D) {
  switch (q_dtype) {
    case kF16:
      return tiled_dense_kernel_f16(D);
    case kBF16:
      return dense_for_dim<__nv_bfloat16>(D);
    default:
      return {};
  }
}

} // namespace mlxq::cuda
