// eval_gpu of RingUpdate and QuantizedRingUpdate on CUDA (kernels in
// ring_update.cu): the output takes over a donatable buffer and only the new
// rows are written; otherwise the buffer is first copied.
#include "cuda/launch.h"
#include "mlx/backend/cuda/utils.h"
#include "ring_update.h"

namespace mlxq {

namespace {

using namespace mlxq::cuda;

constexpr int kRowThreads = 128;

// Makes `out` hold `in`'s data: shared when donatable, else copied on the GPU.
void take_or_copy(const mx::array& in, mx::array& out, mx::cu::CommandEncoder& enc) {
  if (detail::can_update_in_place(in)) {
    out.copy_shared_buffer(in);
    return;
  }
  allocate(out, enc);
  poison(out, enc);
  if (in.size() == 0) {
    return;
  }
  CopyArgs c{};
  c.src = mx::gpu_ptr<void>(in);
  c.dst = mx::gpu_ptr<void>(out);
  copy_strides(in, c.src_st);
  c.B = in.shape(0);
  c.H = in.shape(1);
  c.S = in.shape(2);
  c.D = in.shape(3);
  c.itemsize = static_cast<int>(in.itemsize());
  launch(enc, copy_kernel(), dim3(c.B * c.H * c.S), dim3(kRowThreads), 0, c,
         {&in, &out}, {&out});
}

} // namespace

void RingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  take_or_copy(buffer, out, enc);
  RingArgs r{};
  r.src = mx::gpu_ptr<void>(update);
  r.dst = mx::gpu_ptr<void>(out);
  r.pos = mx::gpu_ptr<int32_t>(inputs[2]);
  copy_strides(update, r.src_st);
  r.B = update.shape(0);
  r.H = update.shape(1);
  r.T = update.shape(2);
  r.S = out.shape(2);
  r.D = out.shape(3);
  r.itemsize = static_cast<int>(out.itemsize());
  if (r.B * r.H * r.T == 0) {
    return;
  }
  launch(enc, ring_kernel(), dim3(r.B * r.H * r.T), dim3(kRowThreads), 0, r,
         {&buffer, &update, &inputs[2], &out}, {&out});
}

void QuantizedRingUpdate::eval_gpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  const auto& pos = inputs[2];
  take_or_copy(buffer, out, enc);
  QuantRingArgs q{};
  q.src = mx::gpu_ptr<void>(update);
  q.dst = mx::gpu_ptr<void>(out);
  q.pos = mx::gpu_ptr<int32_t>(pos);
  copy_strides(update, q.src_st);
  q.B = update.shape(0);
  q.H = update.shape(1);
  q.T = update.shape(2);
  q.D = update.shape(3);
  q.S = out.shape(2);
  q.W = q.D * bits_ / 32;
  q.G = q.D / group_size_;
  q.gs = group_size_;
  q.bits = bits_;
  q.dtype = dtype_code(update.dtype());
  q.part = static_cast<int>(part_);
  if (q.B * q.H * q.T == 0) {
    return;
  }
  launch(enc, quant_ring_kernel(bits_, group_size_), dim3(q.B * q.H * q.T),
         dim3(kRowThreads), 0, q, {&buffer, &update, &pos, &out}, {&out});
}

} // namespace mlxq
