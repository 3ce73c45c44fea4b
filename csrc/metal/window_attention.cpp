// Metal WindowAttention: not yet. Its op refuses Metal streams (as
// quantized_sdpa_with_lse does, whose log-sum-exp it merges with), so no
// node reaches this.
#include <stdexcept>

#include "window_attention.h"

namespace mlxq {

void WindowAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxq.window_attention] runs on the CPU and CUDA, not yet on Metal.");
}

} // namespace mlxq
