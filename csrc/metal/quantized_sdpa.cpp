// Metal QuantizedSDPA: the decode (split-K + merge) or prefill kernel of
// metal/qsdpa_*.metal, dispatched as csrc/metal/dispatch.cpp plans it.
#include "metal/kernels.h"
#include "prefix_view.h"

#include "debug.h"
#include "prefill_route.h"
#include "quantized_sdpa.h"
#include "sdpa_dims.h"
#include "sdpa_problem.h"

namespace mlxq {

namespace {

namespace mh = metal_host;
namespace md = metal_dispatch;

} // namespace

void QuantizedSDPA::eval_gpu(const std::vector<mx::array>& given, std::vector<mx::array>& outputs) {
  const auto inputs = detail::with_prefix_rows(given, 1, 6, params_.rows);
  mx::array& out = outputs[0];
  // Each row's log-sum-exp (quantized_sdpa with return_lse), written by the merge.
  mx::array* lse = outputs.size() > 1 ? &outputs[1] : nullptr;
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  poison_if_enabled(out);
  if (lse) {
    lse->set_data(mx::allocator::malloc(lse->nbytes()));
    poison_if_enabled(*lse);
  }
  if (out.size() == 0) {
    return;
  }

  const mx::array& q = inputs[0];
  // K/V rows must be contiguous along their last axis (every cache and
  // mx.quantize output is); anything else is copied first.
  std::vector<mx::array> kv;
  for (int i = 1; i <= 6; ++i) {
    kv.push_back(mh::rows_contiguous(inputs[i], s));
  }
  const SdpaProblem p = SdpaProblem::from(inputs, params_, out);
  const mx::array* mask = p.mask_input >= 0 ? &inputs[p.mask_input] : nullptr;
  const mx::array* sinks = p.sinks_input >= 0 ? &inputs[p.sinks_input] : nullptr;
  // Metal's plan problem: SdpaProblem's fields, the K/V strides of the
  // (possibly copied) rows, and what the kernels' vector loads need.
  md::SdpaProblem pr;
  copy_dims(p, pr);
  pr.q_dtype = p.q_dtype;
  pr.mask_kind = p.mask;
  pr.mask_dtype = p.mask_dtype;
  pr.has_sinks = p.has_sinks;
  for (int i = 0; i < 4; ++i) {
    pr.q_strides[i] = p.q_st[i];
    pr.m_strides[i] = p.m_st[i];
  }
  for (int part = 0; part < 3; ++part) {
    for (int i = 0; i < 3; ++i) {
      pr.k_strides[part][i] = kv[part].strides()[i];
      pr.v_strides[part][i] = kv[3 + part].strides()[i];
    }
  }
  pr.k_packed_offset = kv[0].offset() / static_cast<int64_t>(sizeof(uint32_t));
  pr.v_packed_offset = kv[3].offset() / static_cast<int64_t>(sizeof(uint32_t));
  pr.k_base_aligned16 = mh::base_aligned16(kv[0]);
  pr.v_base_aligned16 = mh::base_aligned16(kv[3]);
  pr.sinks_stride = p.sinks_stride;
  pr.with_lse = lse != nullptr;

  md::SdpaPlan plan = md::plan_sdpa(pr);
  auto* pipeline = mh::kernel(d, plan.kernel);
  const int max_threads = static_cast<int>(pipeline->maxTotalThreadsPerThreadgroup());
  if (plan.group.x > max_threads) {
    // A register-heavy pipeline: fewer rows (SIMD groups) per threadgroup.
    pr.max_threads = max_threads;
    plan = md::plan_sdpa(pr);
  }

  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(pipeline);
  enc.set_input_array(q, md::slots::kQ);
  const int kv_slots[6] = {
      md::slots::kKPacked,
      md::slots::kKScales,
      md::slots::kKBiases,
      md::slots::kVPacked,
      md::slots::kVScales,
      md::slots::kVBiases};
  for (int i = 0; i < 6; ++i) {
    enc.set_input_array(kv[i], kv_slots[i]);
  }
  enc.set_output_array(out, md::slots::kOut);
  // Absent optional buffers: the kernel never reads them, bind the output.
  enc.set_input_array(mask ? *mask : out, md::slots::kMask);
  enc.set_input_array(sinks ? *sinks : out, md::slots::kSinks);

  if (!plan.merge) {
    if (!plan.prefill) {
      enc.set_input_array(out, md::slots::kPartialO);
      enc.set_input_array(out, md::slots::kPartialML);
    }
    enc.set_bytes(plan.params, md::slots::kSdpaParams);
    mh::dispatch(enc, plan.grid, plan.group, false);
    return;
  }

  // Split-K decode: each key block writes partial outputs and (max, sum).
  mx::array part_o({static_cast<int>(plan.partial_o_floats)}, mx::float32, nullptr, {});
  mx::array part_ml({static_cast<int>(plan.partial_ml_floats)}, mx::float32, nullptr, {});
  part_o.set_data(mx::allocator::malloc(part_o.nbytes()));
  part_ml.set_data(mx::allocator::malloc(part_ml.nbytes()));
  enc.set_output_array(part_o, md::slots::kPartialO);
  enc.set_output_array(part_ml, md::slots::kPartialML);
  enc.set_bytes(plan.params, md::slots::kSdpaParams);
  mh::dispatch(enc, plan.grid, plan.group, false);

  // Log-sum-exp merge of the blocks of every row.
  enc.set_compute_pipeline_state(mh::kernel(d, plan.merge_kernel));
  enc.set_input_array(part_o, md::slots::kMergePartialO);
  enc.set_input_array(part_ml, md::slots::kMergePartialML);
  enc.set_input_array(sinks ? *sinks : out, md::slots::kMergeSinks);
  enc.set_output_array(out, md::slots::kMergeOut);
  enc.set_bytes(plan.params, md::slots::kMergeParams);
  if (lse) {
    enc.set_output_array(*lse, md::slots::kMergeLse);
  } else { // never written (p.with_lse == 0): bind the output
    enc.set_input_array(out, md::slots::kMergeLse);
  }
  mh::dispatch(enc, plan.merge_grid, plan.merge_group, false);
  enc.add_temporary(std::move(part_o));
  enc.add_temporary(std::move(part_ml));
}

GpuBackend gpu_backend() {
  return GpuBackend::Metal;
}

} // namespace mlxq
