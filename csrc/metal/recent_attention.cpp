// Metal has no RecentAttention kernel: its op refuses Metal streams with a
// ValueError, and mlxq.sdpa attends a recent window there with MLX ops (the
// quantized part through quantized_sdpa with return_lse, which Metal serves). So no
// node reaches this.
#include <stdexcept>

#include "recent_attention.h"

namespace mlxq {

void RecentAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[mlxq.recent_attention] runs on the CPU and CUDA, not yet on Metal.");
}

} // namespace mlxq
