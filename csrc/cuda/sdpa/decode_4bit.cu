// Instances of the tensor-core decode kernel for 4-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype) {
  return instance_of<4, 64, 128, 256, 512>(D, gs, scale_dtype, q_dtype);
}

DecodeKernel
decode_kernel(int k_bits, int v_bits, int D, int k_gs, int v_gs, int scale_dtype, int q_dtype) {
  if (q_dtype != kF16 && q_dtype != kBF16) {
    return {};
  }
  if (k_bits == 8 && v_bits == 4) {
    return decode_kernel_k8v4(D, k_gs, v_gs, scale_dtype, q_dtype);
  }
  if (k_bits != v_bits || k_gs != v_gs) {
    return {};
  }
  switch (k_bits) {
    case 4:
      return decode_kernel_4bit(D, k_gs, scale_dtype, q_dtype);
    case 8:
      return decode_kernel_8bit(D, k_gs, scale_dtype, q_dtype);
    default:
      return {};
  }
}

} // namespace mlxq::cuda
