// Metal RingUpdate and QuantizedRingUpdate (metal/ring_update.metal).
//
// As on the CPU, the output takes over the buffer's memory when MLX says it
// may be donated and it is row-contiguous, and only the T new rows are
// written; otherwise the output is a row-contiguous copy (mlxq_copy4d) of the
// buffer and the caller's array is left unchanged.
#include "metal/kernels.h"

#include "debug.h"
#include "ring_update.h"

namespace mlxq {

namespace {

namespace mh = metal_host;
namespace md = metal_dispatch;

// Points `out` at `in`'s memory when it can be updated in place, else gives
// it a copy of `in`.
void take_or_copy(const mx::array& in, mx::array& out, const mx::Stream& s, bool owned = false) {
  if (detail::can_update_in_place(in, owned)) {
    out.copy_shared_buffer(in);
    return;
  }
  detail::note_ring_copy();
  out.set_data(mx::allocator::malloc(out.nbytes()));
  poison_if_enabled(out);
  mh::copy4d(in, out, s);
}

void strides4(const mx::array& a, int64_t (&st)[4]) {
  for (int i = 0; i < 4; ++i) {
    st[i] = a.strides()[i];
  }
}

// One dispatch of mlxq_ring_update: `update`'s rows into `out` at ring rows
// (pos + t) mod S.
void dispatch_rows(
    const mx::Stream& s,
    const mx::array& update,
    const mx::array& pos,
    mx::array& out) {
  auto& d = mx::metal::device(s.device);
  int64_t st[4];
  strides4(update, st);
  const md::RingPlan plan = md::plan_ring_update(
      out.shape(0),
      out.shape(1),
      out.shape(2),
      update.shape(2),
      out.shape(3),
      static_cast<int>(out.itemsize()),
      st);
  if (plan.grid.empty()) {
    return;
  }
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(mh::kernel(d, plan.kernel));
  enc.set_input_array(update, md::slots::kRingUpdate);
  enc.set_input_array(pos, md::slots::kRingPos);
  enc.set_output_array(out, md::slots::kRingOut);
  enc.set_bytes(plan.params, md::slots::kRingParams);
  mh::dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
}

} // namespace

void RingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  take_or_copy(inputs[0], out, stream(), owned_);
  dispatch_rows(stream(), inputs[1], inputs[2], out);
}

namespace {

// One dispatch of mlxq_quantized_ring_update: quantizes `update`'s rows at
// `pos` and writes `part` of them into the arrays bound to the packed,
// scales and biases slots (the same array thrice for a single part; a
// kernel writes only its part's slot, yet every buffer argument is bound).
void dispatch_quantized_rows(
    const mx::Stream& s,
    const mx::array& update,
    const mx::array& pos,
    mx::array& packed,
    mx::array& scales,
    mx::array& biases,
    int part,
    int group_size,
    int bits) {
  int64_t st[4];
  strides4(update, st);
  const md::RingPlan plan = md::plan_quantized_ring_update(
      packed.shape(0),
      packed.shape(1),
      packed.shape(2),
      update.shape(2),
      update.shape(3),
      group_size,
      bits,
      mh::dtype_code(update.dtype()),
      part,
      st);
  if (plan.grid.empty()) {
    return;
  }
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(mh::kernel(mx::metal::device(s.device), plan.kernel));
  enc.set_input_array(update, md::slots::kQRingUpdate);
  enc.set_input_array(pos, md::slots::kQRingPos);
  enc.set_output_array(packed, md::slots::kQRingPacked);
  enc.set_output_array(scales, md::slots::kQRingScales);
  enc.set_output_array(biases, md::slots::kQRingBiases);
  enc.set_bytes(plan.params, md::slots::kQRingParams);
  mh::dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
}

} // namespace

void QuantizedRingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& s = stream();
  take_or_copy(inputs[0], out, s, owned_);
  dispatch_quantized_rows(
      s, inputs[1], inputs[2], out, out, out, static_cast<int>(part_), group_size_, bits_);
}

void QuantizedKVUpdate::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // inputs: K packed, scales, biases, V packed, scales, biases, K update,
  // V update, pos, then (recent) the rings and their rows; outputs: the six
  // buffers (then their fetch views, then the rings). One dispatch per side
  // writes its three arrays (MQ_PART_ALL), one per ring its rows.
  auto& s = stream();
  for (int i = 0; i < 6; ++i) {
    take_or_copy(inputs[i], outputs[i], s, /*owned=*/true);
  }
  detail::set_prefix_views(outputs, fetch_ >= 0);
  for (int kv = 0; recent_ && kv < 2; ++kv) {
    mx::array& ring = outputs[recent_output() + kv];
    take_or_copy(inputs[9 + kv], ring, s, recent_owned_);
    dispatch_rows(s, inputs[11 + kv], inputs[recent_pos_input()], ring);
  }
  for (int kv = 0; kv < 2; ++kv) {
    dispatch_quantized_rows(
        s,
        inputs[6 + kv],
        inputs[8],
        outputs[3 * kv],
        outputs[3 * kv + 1],
        outputs[3 * kv + 2],
        MQ_PART_ALL,
        group_size_[kv],
        bits_[kv]);
  }
}

} // namespace mlxq
