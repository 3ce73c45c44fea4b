// eval_gpu of DequantizeInto on CUDA (kernel in dequantize.cu).
#include "dequantize_into.h"
#include "cuda/launch.h"
#include "mlx/backend/cuda/utils.h"

namespace mlxq {

void DequantizeInto::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  using namespace mlxq::cuda;
  auto& enc = mx::cu::get_command_encoder(stream());
  if (!detail::share_workspace(inputs[0], out)) {
    allocate(out, enc);
  }
  if (out.size() == 0) {
    return;
  }
  // Every input is a dependency of the poisoning fill too: it must not
  // overwrite the workspace before its previous readers ran.
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  poison(out, enc);
  const auto& packed = inputs[1];
  DequantArgs d{};
  d.w = mx::gpu_ptr<uint32_t>(packed);
  d.s = mx::gpu_ptr<void>(inputs[2]);
  d.z = mx::gpu_ptr<void>(inputs[3]);
  d.out = mx::gpu_ptr<void>(out);
  copy_strides(packed, d.w_st);
  copy_strides(inputs[2], d.s_st);
  copy_strides(inputs[3], d.z_st);
  d.H = out.shape(1);
  d.N = out.shape(2);
  d.D = out.shape(3);
  d.gs = group_size_;
  d.s_dtype = dtype_code(inputs[2].dtype());
  d.chunks = static_cast<int64_t>(out.size() / 8);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((d.chunks + threads - 1) / threads, 32L * sm_count());
  launch(
      enc,
      dequantize_kernel(bits_, dtype_code(out.dtype())),
      dim3(static_cast<unsigned>(blocks)),
      dim3(threads),
      0,
      d,
      inputs,
      {out});
}

} // namespace mlxq
