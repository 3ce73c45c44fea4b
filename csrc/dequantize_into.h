// Dequantization into a reused workspace: the transient dense K/V of a
// prefill layer routed to MLX's fused attention (python/mlxq/routing.py).
//
// Why not mx.dequantize: each call returns a fresh O(N * D) buffer, and MLX's
// GPU backends keep every kernel's inputs until the command buffer (Metal) or
// CUDA graph that ran it completes, with several of those in flight. At 128k
// tokens an 8B model's layer dequantizes to 0.5 GB, and tens of layers' copies
// were alive at once. Writing every layer into one buffer bounds that to one
// layer, whatever the context.
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxq {

namespace mx = mlx::core;

/** Inputs: workspace (1-D float, at least B * H * N * D elements), packed
 *  [B, H, N, W] uint32, scales and biases [B, H, N, G], then arrays that must
 *  be evaluated first (the readers of the workspace's previous contents).
 *  Output: [B, H, N, D] in the workspace's dtype, row-contiguous, in the
 *  workspace's memory (scale * code + bias per group, computed in f32).
 *
 *  The write ignores MLX's donation rules on purpose: the workspace belongs
 *  to one caller that orders every write after the last read through the
 *  trailing inputs. Those also order it inside a CUDA graph, whose nodes
 *  wait only for earlier writers of the buffers they touch, not readers. A
 *  workspace that cannot hold the output (too small, not row-contiguous)
 *  gets a fresh buffer instead. */
class DequantizeInto : public mx::UnaryPrimitive {
 public:
  DequantizeInto(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "DequantizeInto";
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  int group_size() const {
    return group_size_;
  }
  int bits() const {
    return bits_;
  }

 private:
  int group_size_;
  int bits_;
};

namespace detail {

// Points `out` at the workspace's memory when it can hold it (returns true),
// else leaves `out` without data (the caller allocates).
bool share_workspace(const mx::array& workspace, mx::array& out);

// Test hook: how many DequantizeInto evaluations could not use their
// workspace since the last call (the count is then reset).
int take_workspace_misses();

} // namespace detail

mx::array dequantize_into(
    const mx::array& workspace,
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const std::vector<mx::array>& after = {},
    mx::StreamOrDevice s = {});

} // namespace mlxq
