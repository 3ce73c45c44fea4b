// eval_gpu for builds without a GPU backend (the CPU-only MLX wheel). The
// Metal and CUDA builds replace this file with their own implementations.
#include <stdexcept>
#include <string>

#include "dequantize_into.h"
#include "prefill_route.h"
#include "quantized_sdpa.h"
#include "recent_attention.h"
#include "ring_update.h"

namespace mlxq {

namespace {

[[noreturn]] void no_gpu_kernels(const char* op, const char* also = "") {
  throw std::runtime_error(
      std::string("[") + op +
      "] this build of mlxq has no GPU kernels; run it on the CPU (stream=mx.cpu)" + also + ".");
}

} // namespace

void QuantizedSDPA::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels("mlxq.quantized_sdpa", " or rebuild mlxq against a Metal or CUDA build of MLX");
}

void RingUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernels("mlxq.ring_update");
}

void QuantizedRingUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernels("mlxq.quantized_ring_update");
}

void QuantizedKVUpdate::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_gpu_kernels("mlxq.quantized_kv_update");
}

void DequantizeInto::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernels("mlxq.dequantize_into");
}

void RecentAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_gpu_kernels("mlxq.recent_attention");
}

GpuBackend gpu_backend() {
  return GpuBackend::None;
}

} // namespace mlxq
