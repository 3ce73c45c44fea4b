// Instances of the tensor-core tiled kernel for f16 queries (one file per
// query dtype so the instances compile in parallel).
#include "cuda/sdpa/tiled.cuh"

namespace mlxq::cuda {

TiledKernel tiled_kernel_f16(int D, int gs, int warps, int keys) {
  return for_dim<__half>(D, gs, warps, keys);
}

TiledKernel tiled_dense_kernel_f16(int D) {
  return dense_for_dim<__half>(D);
}

} // namespace mlxq::cuda
