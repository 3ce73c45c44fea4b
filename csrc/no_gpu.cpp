// eval_gpu for builds without a GPU backend (the CPU-only MLX wheel). The
// Metal and CUDA builds replace this file with their own implementations.
#include <stdexcept>

#include "quantized_sdpa.h"

namespace mlxq {

void QuantizedSDPA::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxq.quantized_sdpa] this build of mlxq has no GPU kernels; "
      "run it on the CPU (stream=mx.cpu) or rebuild mlxq against a Metal or "
      "CUDA build of MLX.");
}

} // namespace mlxq

#include "ring_update.h"

namespace mlxq {

void RingUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxq.ring_update] this build of mlxq has no GPU kernels; run it on "
      "the CPU (stream=mx.cpu).");
}

void QuantizedRingUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxq.quantized_ring_update] this build of mlxq has no GPU kernels; "
      "run it on the CPU (stream=mx.cpu).");
}

} // namespace mlxq

namespace mlxq {

void QuantizedKVUpdate::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[mlxq.quantized_kv_update] this build of mlxq has no GPU kernels; "
      "run it on the CPU (stream=mx.cpu).");
}

} // namespace mlxq

#include "dequantize_into.h"

namespace mlxq {

void DequantizeInto::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxq.dequantize_into] this build of mlxq has no GPU kernels; run it on "
      "the CPU (stream=mx.cpu).");
}

} // namespace mlxq
