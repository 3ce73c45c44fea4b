// eval_gpu of RecentAttention on CUDA (kernel in recent_attention.cu).
#include "recent_attention.h"
#include "cuda/launch.h"

#include <stdexcept>

namespace mlxq {

namespace cuda {

void launch_recent(
    mx::cu::CommandEncoder& enc,
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& out_q,
    const mx::array& lse_q,
    const mx::array& out,
    float scale,
    bool causal) {
  WindowArgs a{};
  a.q = mx::gpu_ptr<void>(q);
  a.k = mx::gpu_ptr<void>(k);
  a.v = mx::gpu_ptr<void>(v);
  a.out_q = mx::gpu_ptr<void>(out_q);
  a.lse_q = mx::gpu_ptr<float>(lse_q);
  a.out = mx::gpu_ptr<void>(out);
  copy_strides(q, a.q_st);
  copy_strides(k, a.k_st);
  copy_strides(v, a.v_st);
  copy_strides(out_q, a.o_st);
  for (int i = 0; i < 3; ++i) {
    a.l_st[i] = lse_q.strides()[i];
  }
  a.Hq = q.shape(1);
  a.L = q.shape(2);
  a.T = k.shape(2);
  a.Dk = q.shape(3);
  a.Dv = v.shape(3);
  a.rep = q.shape(1) / k.shape(1);
  a.dtype = dtype_code(q.dtype());
  a.scale = scale;
  a.causal = causal ? 1 : 0;
  const int rows = q.shape(0) * a.Hq * a.L;
  if (rows == 0) {
    return;
  }
  launch(
      enc,
      window_kernel(),
      dim3(rows),
      dim3(kWindowWarps * 32),
      0,
      a,
      {&q, &k, &v, &out_q, &lse_q, &out},
      {&out});
}

} // namespace cuda

void RecentAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  if (inputs.size() > 5) { // (the op refuses a mask array on a GPU stream)
    throw std::runtime_error("[mlxq.recent_attention] takes a mask array on the CPU only.");
  }
  auto& enc = mx::cu::get_command_encoder(stream());
  cuda::allocate(out, enc);
  cuda::poison(out, enc);
  cuda::launch_recent(
      enc, inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], out, scale_, causal_);
}

} // namespace mlxq
