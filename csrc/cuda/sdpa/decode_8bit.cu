// Instances of the tensor-core decode kernel for 8-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_8bit(int D, int gs, int scale_dtype, int q_dtype) {
  if (D == 64 && gs == 32) {
    return instance<8, 64, 32>(scale_dtype, q_dtype);
  }
  if (D == 64 && gs == 64) {
    return instance<8, 64, 64>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 32) {
    return instance<8, 128, 32>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 64) {
    return instance<8, 128, 64>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 128) {
    return instance<8, 128, 128>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 32) {
    return instance<8, 256, 32>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 64) {
    return instance<8, 256, 64>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 128) {
    return instance<8, 256, 128>(scale_dtype, q_dtype);
  }
  return {};
}

} // namespace mlxq::cuda
