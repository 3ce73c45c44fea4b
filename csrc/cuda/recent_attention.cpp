// eval_gpu of RecentAttention on CUDA (kernel in recent_attention.cu).
#include "recent_attention.h"
#include "cuda/launch.h"

namespace mlxq {

using namespace mlxq::cuda;

void RecentAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& out_q = inputs[3];
  const auto& lse_q = inputs[4];
  allocate(out, enc);
  poison(out, enc);
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
  a.scale = scale_;
  a.causal = causal_ ? 1 : 0;
  const int rows = q.shape(0) * a.Hq * a.L;
  if (rows == 0) {
    return;
  }
  launch(enc, window_kernel(), dim3(rows), dim3(kWindowWarps * 32), 0, a, inputs, {out});
}

} // namespace mlxq
