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

/** Inputs: packed, scales, biases (a quantized buffer of S rows), update
 *  [B, H, T, D] float, pos. Outputs: the three arrays with update row t
 *  quantized (bit-identical to mx.quantize on this backend) into row
 *  (pos + t) mod S. */
class QuantizedRingUpdate : public mx::Primitive {
 public:
  QuantizedRingUpdate(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QuantizedRingUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
  }
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

// Shared by the backends' eval functions.
namespace detail {

// True when `buffer`'s memory may become the output's (MLX says it is not
// referenced elsewhere) and is row-contiguous, so only new rows are written.
bool can_update_in_place(const mx::array& buffer);

// mx::array::make_arrays gives each output of a multi-output primitive its
// own copy of the input list, so every input is referenced once per output
// and never looks donatable. Only the list this evaluation reads is needed
// (MLX detaches all outputs right after), so the siblings' copies are dropped
// first: an input then counts as donatable exactly when a single-output
// primitive's input would.
void release_sibling_inputs(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

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
