// Metal DequantizeInto (metal/dequantize.metal): the output takes the
// workspace's memory when detail::share_workspace allows it (else a fresh
// buffer), and mlxq_dequantize_into writes it from the strided packed /
// scales / biases views. The workspace and the trailing `after` inputs are
// bound too, so MLX's encoder orders the write after the dispatches that
// produced them (the readers of the workspace's previous contents).
#include "metal/kernels.h"

#include "debug.h"
#include "dequantize_into.h"

namespace mlxq {

namespace {

namespace mh = metal_host;
namespace md = metal_dispatch;

void strides4(const mx::array& a, int64_t (&st)[4]) {
  for (int i = 0; i < 4; ++i) {
    st[i] = a.strides()[i];
  }
}

// Binds the workspace (inputs[0]) and the `after` inputs (inputs[4...]) one
// after another to `slot`, which the kernel never reads: set_input_array is
// what makes MLX's encoder put a barrier before this dispatch when an earlier
// one of the command buffer wrote them.
void bind_order_inputs(
    mx::metal::CommandEncoder& enc,
    const std::vector<mx::array>& inputs,
    int slot) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if ((i == 0 || i >= 4) && inputs[i].nbytes() > 0) {
      enc.set_input_array(inputs[i], slot);
    }
  }
}

} // namespace

void DequantizeInto::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  if (!detail::share_workspace(inputs[0], out)) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  if (out.size() == 0) {
    return;
  }
  auto& enc = mx::metal::get_command_encoder(s);
  const int out_dtype = mh::dtype_code(out.dtype());

  // Poisoned on the GPU, in stream order. The other Metal primitives poison
  // a fresh output on the host (poison_if_enabled) at encode time, which is
  // safe only because nothing else uses a fresh buffer yet; the workspace's
  // previous contents may still be read by dispatches in flight, which a host
  // fill would race with. So the fill is a dispatch ordered like the write
  // itself (after every input), for a fresh buffer too: one path.
  if (poison_outputs()) {
    const md::FillPlan fill =
        md::plan_fill_u32(static_cast<int64_t>(out.nbytes() / 4), md::poison_word(out_dtype));
    enc.set_compute_pipeline_state(mh::kernel(d, fill.kernel));
    bind_order_inputs(enc, inputs, md::slots::kFillOrder);
    enc.set_output_array(out, md::slots::kFillDst);
    enc.set_bytes(fill.params, md::slots::kFillParams);
    mh::dispatch(enc, fill.grid, fill.group, fill.grid_is_threads);
  }

  const mx::array& packed = inputs[1];
  const mx::array& scales = inputs[2];
  const mx::array& biases = inputs[3];
  int64_t w_st[4], s_st[4], b_st[4];
  strides4(packed, w_st);
  strides4(scales, s_st);
  strides4(biases, b_st);
  const md::DequantPlan plan = md::plan_dequantize_into(
      out.shape(0),
      out.shape(1),
      out.shape(2),
      out.shape(3),
      group_size_,
      bits_,
      out_dtype,
      mh::dtype_code(scales.dtype()),
      w_st,
      s_st,
      b_st);
  enc.set_compute_pipeline_state(mh::kernel(d, plan.kernel));
  bind_order_inputs(enc, inputs, md::slots::kDqOrder);
  enc.set_input_array(packed, md::slots::kDqPacked);
  enc.set_input_array(scales, md::slots::kDqScales);
  enc.set_input_array(biases, md::slots::kDqBiases);
  // After the fill too: `out` was its output, so this binding adds the
  // barrier between the two dispatches.
  enc.set_output_array(out, md::slots::kDqOut);
  enc.set_bytes(plan.params, md::slots::kDqParams);
  mh::dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
}

} // namespace mlxq
