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
void take_or_copy(const mx::array& in, mx::array& out, const mx::Stream& s,
                  bool owned = false) {
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

} // namespace

void RingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  const mx::array& buffer = inputs[0];
  const mx::array& update = inputs[1];
  const mx::array& pos = inputs[2];
  take_or_copy(buffer, out, s, owned_);

  int64_t st[4];
  strides4(update, st);
  const md::RingPlan plan = md::plan_ring_update(
      out.shape(0), out.shape(1), out.shape(2), update.shape(2), out.shape(3),
      static_cast<int>(out.itemsize()), st);
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

void QuantizedRingUpdate::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  const mx::array& buffer = inputs[0];
  const mx::array& update = inputs[1];
  const mx::array& pos = inputs[2];
  take_or_copy(buffer, out, s);

  int64_t st[4];
  strides4(update, st);
  const md::RingPlan plan = md::plan_quantized_ring_update(
      out.shape(0), out.shape(1), out.shape(2), update.shape(2),
      update.shape(3), group_size_, bits_, mh::dtype_code(update.dtype()),
      static_cast<int>(part_), st);
  if (plan.grid.empty()) {
    return;
  }
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(mh::kernel(d, plan.kernel));
  enc.set_input_array(update, md::slots::kQRingUpdate);
  enc.set_input_array(pos, md::slots::kQRingPos);
  // The kernel writes only this part's slot; the same array fills the other
  // two so that every buffer argument is bound.
  enc.set_output_array(out, md::slots::kQRingPacked);
  enc.set_output_array(out, md::slots::kQRingScales);
  enc.set_output_array(out, md::slots::kQRingBiases);
  enc.set_bytes(plan.params, md::slots::kQRingParams);
  mh::dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
}

void QuantizedKVUpdate::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // inputs: K packed, scales, biases, V packed, scales, biases, K update,
  // V update, pos; outputs: the six buffers. One dispatch per side writes
  // its three arrays (MLXQ_PART_ALL).
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  for (int i = 0; i < 6; ++i) {
    take_or_copy(inputs[i], outputs[i], s, /*owned=*/true);
  }
  const mx::array& pos = inputs[8];
  auto& enc = mx::metal::get_command_encoder(s);
  for (int kv = 0; kv < 2; ++kv) {
    const mx::array& update = inputs[6 + kv];
    const mx::array& packed = outputs[3 * kv];
    int64_t st[4];
    strides4(update, st);
    const md::RingPlan plan = md::plan_quantized_ring_update(
        packed.shape(0), packed.shape(1), packed.shape(2), update.shape(2),
        update.shape(3), group_size_, bits_, mh::dtype_code(update.dtype()),
        MLXQ_PART_ALL, st);
    if (plan.grid.empty()) {
      return;
    }
    enc.set_compute_pipeline_state(mh::kernel(d, plan.kernel));
    enc.set_input_array(update, md::slots::kQRingUpdate);
    enc.set_input_array(pos, md::slots::kQRingPos);
    enc.set_output_array(outputs[3 * kv], md::slots::kQRingPacked);
    enc.set_output_array(outputs[3 * kv + 1], md::slots::kQRingScales);
    enc.set_output_array(outputs[3 * kv + 2], md::slots::kQRingBiases);
    enc.set_bytes(plan.params, md::slots::kQRingParams);
    mh::dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
  }
}

} // namespace mlxq
