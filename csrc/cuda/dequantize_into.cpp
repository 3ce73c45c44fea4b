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
  DequantLaunch l = dequantize_launch(
      inputs[1],
      inputs[2],
      inputs[3],
      mx::gpu_ptr<void>(out),
      dtype_code(out.dtype()),
      out.shape(3),
      group_size_,
      bits_);
  launch(enc, l.kernel, l.grid, l.block, 0, l.args, inputs, {out});
}

} // namespace mlxq
