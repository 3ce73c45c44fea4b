// Instances of the tensor-core decode kernel for 4-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype) {
  return instance_of<4, 64, 128, 256, 512>(D, gs, scale_dtype, q_dtype);
}

DecodeKernel decode_kernel(int bits, int D, int gs, int scale_dtype, int q_dtype) {
  if (q_dtype != kF16 && q_dtype != kBF16) {
    return {};
  }
  switch (bits) {
    case 4:
      return decode_kernel_4bit(D, gs, scale_dtype, q_dtype);
    case 8:
      return decode_kernel_8bit(D, gs, scale_dtype, q_dtype);
    default:
      return {};
  }
}

} // namespace mlxq::cuda
