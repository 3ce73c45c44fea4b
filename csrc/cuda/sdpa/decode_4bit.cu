// Instances of the tensor-core decode kernel for 4-bit codes (one file
// per width so the instances compile in parallel).
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel decode_kernel_4bit(int D, int gs, int scale_dtype, int q_dtype) {
  return instance_of<4, 64, 128, 256, 512>(D, gs, scale_dtype, q_dtype);
}

DecodeKernel decode_kernel(
    int D,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    int scale_dtype,
    int q_dtype) {
  if (q_dtype != kF16 && q_dtype != kBF16) {
    return {};
  }
  if (k_bits == 8 && v_bits == 4) {
    return decode_kernel_k8v4(D, k_group_size, v_group_size, scale_dtype, q_dtype);
  }
  if (k_bits != v_bits || k_group_size != v_group_size) {
    return {};
  }
  switch (k_bits) {
    case 4:
      return decode_kernel_4bit(D, k_group_size, scale_dtype, q_dtype);
    case 8:
      return decode_kernel_8bit(D, k_group_size, scale_dtype, q_dtype);
    default:
      return {};
  }
}

} // namespace mlxq::cuda
