// DequantizeInto on Metal: not implemented yet. The Python layer routes
// Metal prefill through mx.dequantize instead (python/mlxq/workspace.py), so
// only a direct call reaches this.
#include <stdexcept>

#include "dequantize_into.h"

namespace mlxq {

void DequantizeInto::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "[mlxq.dequantize_into] has no Metal kernel yet; run it on the CPU "
      "(stream=mx.cpu) or use mx.dequantize.");
}

} // namespace mlxq
