// Instances of the tensor-core decode kernel for 4-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype) {
  if (D == 64 && gs == 32) {
    return instance<4, 64, 32>(scale_dtype, q_dtype);
  }
  if (D == 64 && gs == 64) {
    return instance<4, 64, 64>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 32) {
    return instance<4, 128, 32>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 64) {
    return instance<4, 128, 64>(scale_dtype, q_dtype);
  }
  if (D == 128 && gs == 128) {
    return instance<4, 128, 128>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 32) {
    return instance<4, 256, 32>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 64) {
    return instance<4, 256, 64>(scale_dtype, q_dtype);
  }
  if (D == 256 && gs == 128) {
    return instance<4, 256, 128>(scale_dtype, q_dtype);
  }
  if (D == 512 && gs == 32) {
    return instance<4, 512, 32>(scale_dtype, q_dtype);
  }
  if (D == 512 && gs == 64) {
    return instance<4, 512, 64>(scale_dtype, q_dtype);
  }
  if (D == 512 && gs == 128) {
    return instance<4, 512, 128>(scale_dtype, q_dtype);
  }
  return {};
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
