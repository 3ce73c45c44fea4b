// Instances of the tensor-core decode kernel for 8-bit keys with 4-bit
// values (llama.cpp's q8_0-K / q4_0-V pair: keys carry most of 4-bit KV's
// accuracy loss), in a file of their own so they compile in parallel.
#include "cuda/sdpa/decode.cuh"

namespace mlxq::cuda {

DecodeKernel
decode_kernel_k8v4(int D, int k_group_size, int v_group_size, int scale_dtype, int q_dtype) {
  return pair_instance_of<8, 4, 64, 128, 256>(D, k_group_size, v_group_size, scale_dtype, q_dtype);
}

} // namespace mlxq::cuda
