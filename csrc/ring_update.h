// Ring-buffer writes into KV-cache buffers, in place when the buffer can be
// donated: O(rows written) per decoded token instead of a copy of the buffer.
#pragma once

#include <array>
#include <optional>

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
  explicit RingUpdate(mx::Stream stream, bool owned = false)
      : mx::UnaryPrimitive(stream), owned_(owned) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "RingUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return owned_ == static_cast<const RingUpdate&>(other).owned_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
  bool owned() const {
    return owned_;
  }

 private:
  bool owned_;
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

  QuantizedRingUpdate(mx::Stream stream, int group_size, int bits, Part part, bool owned = false)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        part_(part),
        owned_(owned) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "QuantizedRingUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
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
  bool owned() const {
    return owned_;
  }

 private:
  int group_size_;
  int bits_;
  Part part_;
  bool owned_; // as RingUpdate's: the caller is the buffer's only holder
};

/** The cache write of one step: quantizes the new K and V rows and writes
 *  codes, scales and biases of both, in one kernel launch (a stock bf16 layer
 *  launches two writes; three single-part writes per triple would be six).
 *  Inputs: K packed, scales, biases, V packed, scales, biases (each
 *  [B, H, S, *]), K update [B, H, T, Dk], V update [B, H, T, Dv], pos.
 *  Outputs: the six buffers, updated at rows (pos + t) mod S.
 *
 *  Always "owned" (see can_update_in_place): a KV cache is the only holder of
 *  its buffers, so they are written in place even while MLX's in-flight
 *  command buffers (async_eval pipelining) or earlier fetches still share
 *  their memory. Those only read rows this write does not touch (a growing
 *  cache writes past every earlier fetch), or they run before it in stream
 *  order (a ring overwrites the rows the previous step attended to, and the
 *  next token depends on that step's attention). With several outputs, MLX
 *  also keeps each output's siblings referenced until the command buffer
 *  completes, which would make donation impossible at every step. */
class QuantizedKVUpdate : public mx::Primitive {
 public:
  // `static_pos` >= 0: the write position, known when the op was built (a
  // Python int); the kernels then take it as an argument instead of reading
  // the pos input, which on CUDA lives in host-mapped memory. -1: read pos.
  // `fetch` in [0, S): six more outputs, rows [0, fetch) of the six buffers
  // as views (a cache's fetch, without six Slice primitives per layer to
  // build and evaluate). -1: none.
  // `recent`: the cache's exact window is written too (see RecentWrite).
  // K (side 0) and V (side 1) have their own group size and bits.
  QuantizedKVUpdate(
      mx::Stream stream,
      std::array<int, 2> group_size,
      std::array<int, 2> bits,
      int static_pos = -1,
      int fetch = -1,
      bool recent = false,
      bool recent_owned = false,
      int recent_pos = kSamePos)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        static_pos_(static_pos),
        fetch_(fetch),
        recent_(recent),
        recent_owned_(recent_owned),
        recent_pos_(recent_pos) {}

  // recent_pos: the rings' write position. kSamePos: the buffers' (no input
  // 13); >= 0: known when the op was built (input 13 holds it too); -1: read
  // input 13.
  static constexpr int kSamePos = -2;

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "QuantizedKVUpdate";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  int group_size(int side) const {
    return group_size_[side];
  }
  int bits(int side) const {
    return bits_[side];
  }
  bool same_quantization() const {
    return group_size_[0] == group_size_[1] && bits_[0] == bits_[1];
  }
  int static_pos() const {
    return static_pos_;
  }
  int fetch() const {
    return fetch_;
  }
  bool recent() const {
    return recent_;
  }
  bool recent_owned() const {
    return recent_owned_;
  }
  int recent_pos() const {
    return recent_pos_;
  }
  // The input holding the rings' write position.
  int recent_pos_input() const {
    return recent_pos_ == kSamePos ? 8 : 13;
  }
  // Index of the first recent ring among the outputs (after the views).
  int recent_output() const {
    return fetch_ >= 0 ? 12 : 6;
  }

 private:
  std::array<int, 2> group_size_;
  std::array<int, 2> bits_;
  int static_pos_;
  int fetch_;
  bool recent_;
  bool recent_owned_;
  int recent_pos_;
};

/** The exact window a quantized cache keeps beside its buffers
 *  (python/mlxq/cache/recent.py), written by the same QuantizedKVUpdate: a
 *  decode step then costs one node per layer, not three (on CUDA each node
 *  is host time in a launch-bound step). Inputs 9..12 of the primitive, in
 *  this order; outputs: the two rings, after the buffers and views.
 *
 *  `keys` / `values`: the rings [B, H, R, Dk] / [B, H, R, Dv] in the rows'
 *  dtype. `key_rows` / `value_rows`: [B, H, T, D], T <= R, the step's rows as
 *  they came (the quantized write may take them in the Hadamard basis); row
 *  t lands on ring row (pos + t) mod R, pos being the quantized write's, or
 *  the rings' own `pos` when given (input 13: a sliding-window cache writes
 *  its buffers at its ring index and the window at the token's position).
 *  `owned`: write the rings in place whatever MLX's donation rule says (the
 *  caller knows every earlier reader runs first); else as RingUpdate. */
struct RecentWrite {
  mx::array keys;
  mx::array values;
  mx::array key_rows;
  mx::array value_rows;
  bool owned = false;
  std::optional<Position> pos;
};

// Shared by the backends' eval functions.
namespace detail {

// QuantizedKVUpdate's fetch outputs (6..11, when it has `views`), once the
// six buffers (0..5) have their data: views of rows [0, fetch), as mx::slice
// would make them.
void set_prefix_views(std::vector<mx::array>& outputs, bool views);

// True when `buffer`'s memory may become the output's and is row-contiguous
// with no gaps, so only new rows are written. Not owned: only when MLX says
// it is donatable (nothing else holds the array or its memory). Owned: the
// caller (a KV cache) is the buffer's only holder, so views and MLX's
// in-flight command buffers that still share the memory do not force a copy.
bool can_update_in_place(const mx::array& buffer, bool owned = false);

// Test hook: how many ring/KV writes copied their buffer instead of writing
// in place since the last call (the count is then reset).
void note_ring_copy();
int take_ring_copies();

} // namespace detail

mx::array ring_update(
    const mx::array& buffer,
    const mx::array& update,
    const Position& pos,
    bool owned = false,
    mx::StreamOrDevice s = {});

// A recent window's step of several rows in one host call (mlxq.cache.recent:
// RecentWindow.step): the step's exact rows, the `span` tokens before it
// from the rings (slots [start, start + span) mod S, oldest first) then
// its own rows, and both rings with the step's last min(T, S) rows written
// at slot `pos`. The rings are read before they are written (the write
// copies them). Returns {exact keys, exact values, keys ring, values ring}.
std::vector<mx::array> window_step(
    const mx::array& keys_ring,
    const mx::array& values_ring,
    const mx::array& keys,
    const mx::array& values,
    int start,
    int span,
    int pos,
    mx::StreamOrDevice s = {});

std::vector<mx::array> quantized_ring_update(
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& update,
    const Position& pos,
    int group_size,
    int bits,
    bool owned = false,
    mx::StreamOrDevice s = {});

// Quantizes and writes one step's K and V rows into a cache's two triples
// (one QuantizedKVUpdate); returns K packed, scales, biases, V packed,
// scales, biases, then (fetch >= 0) the same six arrays' rows [0, fetch) as
// views, then (recent) the two rings updated. Values take v_group_size /
// v_bits when given, else K's.
std::vector<mx::array> quantized_kv_update(
    const std::vector<mx::array>& k_triple,
    const std::vector<mx::array>& v_triple,
    const mx::array& k_update,
    const mx::array& v_update,
    const Position& pos,
    int group_size,
    int bits,
    int fetch = -1,
    std::optional<int> v_group_size = std::nullopt,
    std::optional<int> v_bits = std::nullopt,
    const std::optional<RecentWrite>& recent = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace mlxq
