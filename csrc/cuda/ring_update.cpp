// eval_gpu of RingUpdate and QuantizedRingUpdate on CUDA (kernels in
// ring_update.cu): the output takes over a donatable buffer and only the new
// rows are written; otherwise the buffer is first copied.
#include "ring_update.h"
#include "cuda/launch.h"
#include "mlx/backend/cuda/utils.h"

namespace mlxq {

namespace {

using namespace mlxq::cuda;

constexpr int kRowThreads = 128;

// Makes `out` hold `in`'s data: shared when it can be updated in place (see
// can_update_in_place), else copied on the GPU.
void take_or_copy(
    const mx::array& in,
    mx::array& out,
    mx::cu::CommandEncoder& enc,
    bool owned = false) {
  if (detail::can_update_in_place(in, owned)) {
    out.copy_shared_buffer(in);
    return;
  }
  detail::note_ring_copy();
  // MLX's allocator (managed memory), not mlxq's pool: a cache writes this
  // buffer in place from now on, also in graphs already committed when the
  // host reads the cache (a save), and MLX moves a device block to managed
  // memory on a host read, freeing the pointer those graphs hold.
  allocate_cached(out);
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
  launch(enc, copy_kernel(), dim3(c.B * c.H * c.S), dim3(kRowThreads), 0, c, {&in, &out}, {&out});
}

} // namespace

void RingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  take_or_copy(buffer, out, enc, owned_);
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
  launch(
      enc,
      ring_kernel(),
      dim3(r.B * r.H * r.T),
      dim3(kRowThreads),
      0,
      r,
      {&buffer, &update, &inputs[2], &out},
      {&out});
}

void QuantizedRingUpdate::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  const auto& buffer = inputs[0];
  const auto& update = inputs[1];
  const auto& pos = inputs[2];
  take_or_copy(buffer, out, enc, owned_);
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
  launch(
      enc,
      quant_ring_kernel(bits_, group_size_),
      dim3(q.B * q.H * q.T),
      dim3(kRowThreads),
      0,
      q,
      {&buffer, &update, &pos, &out},
      {&out});
}

void QuantizedKVUpdate::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  // inputs: K packed, scales, biases, V packed, scales, biases, K update,
  // V update, pos, then (recent) the rings and their rows; outputs: the six
  // buffers (then their fetch views, then the rings).
  auto& enc = mx::cu::get_command_encoder(stream());
  for (int i = 0; i < 6; ++i) {
    take_or_copy(inputs[i], outputs[i], enc, /*owned=*/true);
  }
  detail::set_prefix_views(outputs, fetch_ >= 0);
  // A position known at build time is passed by value: the pos array lives
  // in host-mapped memory on CUDA, and reading it would cost each block a
  // round trip over the host link.
  const int32_t* pos_ptr = static_pos_ >= 0 ? nullptr : mx::gpu_ptr<int32_t>(inputs[8]);
  // The kernels read the rings too when they were copied (the copy must run
  // first), so the launches list them among their reads.
  std::vector<mx::array> reads = inputs;
  for (int kv = 0; recent_ && kv < 2; ++kv) {
    mx::array& ring = outputs[recent_output() + kv];
    take_or_copy(inputs[9 + kv], ring, enc, recent_owned_);
    reads.push_back(ring);
  }
  const auto& k_update = inputs[6];
  QuantKVArgs q{};
  for (int kv = 0; kv < 2; ++kv) {
    const auto& update = inputs[6 + kv];
    QuantKVSide& d = q.side[kv];
    d.src = mx::gpu_ptr<void>(update);
    copy_strides(update, d.src_st);
    d.codes = mx::gpu_ptr<uint32_t>(outputs[3 * kv]);
    d.scales = mx::gpu_ptr<void>(outputs[3 * kv + 1]);
    d.biases = mx::gpu_ptr<void>(outputs[3 * kv + 2]);
    d.D = update.shape(3);
    d.W = d.D * bits_[kv] / 32;
    d.G = d.D / group_size_[kv];
    if (recent_) { // the window's rows go in the same launch
      const mx::array& ring = outputs[recent_output() + kv];
      const mx::array& rows = inputs[11 + kv];
      d.recent = mx::gpu_ptr<void>(ring);
      d.recent_src = mx::gpu_ptr<void>(rows);
      copy_strides(rows, d.recent_src_st);
      d.R = ring.shape(2);
      d.itemsize = static_cast<int>(ring.itemsize());
    }
  }
  q.pos = pos_ptr;
  q.pos_value = static_pos_;
  if (recent_ && recent_pos_ != kSamePos) {
    q.recent_own_pos = 1;
    q.recent_pos = recent_pos_ >= 0 ? nullptr : mx::gpu_ptr<int32_t>(inputs[recent_pos_input()]);
    q.recent_pos_value = recent_pos_;
  }
  q.B = k_update.shape(0);
  q.H = k_update.shape(1);
  q.T = k_update.shape(2);
  q.S = outputs[0].shape(2);
  q.dtype = dtype_code(k_update.dtype());
  if (q.B * q.H * q.T == 0) {
    return;
  }
  const unsigned rows = unsigned(q.B * q.H * q.T);
  if (same_quantization()) { // one launch: grid y is the side
    launch(
        enc,
        quant_kv_kernel(bits_[0], group_size_[0]),
        dim3(rows, 2),
        dim3(kRowThreads),
        0,
        q,
        reads,
        outputs);
    return;
  }
  // K and V quantized apart: one launch where a kernel takes the pair, else
  // each side's kernel, one launch each (side[0] is the one a grid of
  // height 1 reads).
  if (void* pair = quant_kv_pair_kernel(bits_[0], group_size_[0], bits_[1], group_size_[1])) {
    launch(enc, pair, dim3(rows, 2), dim3(kRowThreads), 0, q, reads, outputs);
    return;
  }
  for (int kv = 0; kv < 2; ++kv) {
    QuantKVArgs one = q;
    one.side[0] = q.side[kv];
    launch(
        enc,
        quant_kv_kernel(bits_[kv], group_size_[kv]),
        dim3(rows, 1),
        dim3(kRowThreads),
        0,
        one,
        reads,
        outputs);
  }
}

} // namespace mlxq
