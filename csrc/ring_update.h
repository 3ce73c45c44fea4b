// Ring-buffer writes into KV-cache buffers, in place when the buffer can be
// donated: O(rows written) per decoded token instead of a copy of the buffer.
#pragma once

#include <variant>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlxq {

namespace mx = mlx::core;

// A write position: a Python int, or an int32 array (so that a compiled
// decode step does not retrace per token).
using Position = std::variant<int, mx::array>;

/** Inputs: buffer [B, H, S, D], update [B, H, T, D], pos (int32, one element).
 *  Output: buffer with update row t at sequence row (pos + t) mod S. */
class RingUpdate : public mx::UnaryPrimitive {
 public:
  explicit RingUpdate(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "RingUpdate";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

/** One array of a quantized ring buffer. Inputs: that part's buffer (packed
 *  uint32 [B, H, S, W], or scales / biases [B, H, S, G]), update [B, H, T, D]
 *  float, pos. Output: the buffer with update row t quantized (bit-identical
 *  to mx.quantize on this backend) into row (pos + t) mod S; only this part
 *  is written.
 *
 *  One single-output primitive per part, not one primitive with three
 *  outputs: MLX's GPU eval (Metal and CUDA) keeps every input other than the
 *  evaluated output's own buffer, and every sibling output, alive until the
 *  command buffer completes (after mx.eval returns), so with three outputs
 *  none of the buffers could be donated at the next step and each token
 *  would copy the whole cache. Each part re-quantizes the T new rows (cheap)
 *  and writes only its own array. */
class QuantizedRingUpdate : public mx::UnaryPrimitive {
 public:
  enum class Part : int { Codes = 0, Scales = 1, Biases = 2 };

  QuantizedRingUpdate(mx::Stream stream, int group_size, int bits, Part part)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        part_(part) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "QuantizedRingUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  int group_size() const {
    return group_size_;
  }
  int bits() const {
    return bits_;
  }
  Part part() const {
    return part_;
  }

 private:
  int group_size_;
  int bits_;
  Part part_;
};

// Shared by the backends' eval functions.
namespace detail {

// True when `buffer`'s memory may become the output's (MLX says it is not
// referenced elsewhere) and is row-contiguous, so only new rows are written.
bool can_update_in_place(const mx::array& buffer);

} // namespace detail

mx::array ring_update(
    const mx::array& buffer,
    const mx::array& update,
    const Position& pos,
    mx::StreamOrDevice s = {});

std::vector<mx::array> quantized_ring_update(
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& update,
    const Position& pos,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

} // namespace mlxq
