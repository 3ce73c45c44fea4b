// Instances of the tensor-core decode kernel for 8-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_8bit(int D, int gs, int scale_dtype, int q_dtype) {
  return instance_of<8, 64, 128, 256>(D, gs, scale_dtype, q_dtype);
}

} // namespace mlxq::cuda
