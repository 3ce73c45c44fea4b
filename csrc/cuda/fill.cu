// Fills a buffer with one 32-bit word: the output poisoning of every mlxq
// primitive under test (see debug.h), and the decode kernel's zeroed tickets.
#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

__global__ void fill_kernel_impl(FillArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.n_words) {
    static_cast<uint32_t*>(a.dst)[i] = a.value;
  }
}

} // namespace

void* fill_kernel() {
  return handle<fill_kernel_impl>();
}

} // namespace mlxq::cuda
