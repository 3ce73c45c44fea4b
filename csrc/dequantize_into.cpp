#include "dequantize_into.h"

#include <atomic>

#include "quantization.h"
#include "validation.h"

namespace mlxq {

namespace {

constexpr const char* kOp = "mlxq.dequantize_into";

std::atomic<int> workspace_misses{0};

} // namespace

namespace detail {

bool share_workspace(const mx::array& workspace, mx::array& out) {
  if (!workspace.flags().row_contiguous || workspace.data_size() < out.size()) {
    workspace_misses.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  auto flags = workspace.flags();
  flags.contiguous = flags.row_contiguous = true;
  flags.col_contiguous = out.size() <= 1;
  mx::Strides strides(4, 1);
  for (int d = 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * out.shape(d + 1);
  }
  out.copy_shared_buffer(workspace, strides, flags, out.size());
  return true;
}

int take_workspace_misses() {
  return workspace_misses.exchange(0, std::memory_order_relaxed);
}

} // namespace detail

std::vector<mx::Shape> DequantizeInto::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[1].shape();
  shape[3] = shape[3] * 32 / bits_;
  return {shape};
}

mx::array dequantize_into(
    const mx::array& workspace,
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const std::vector<mx::array>& after,
    mx::StreamOrDevice s) {
  if (!is_supported_bits(bits)) {
    fail(kOp, "bits must be one of ", supported_bits_text(), ", got ", bits, ".");
  }
  if (!is_supported_group_size(group_size)) {
    fail(
        kOp, "group_size must be one of ", supported_group_sizes_text(), ", got ", group_size, ".");
  }
  if (workspace.ndim() != 1 || !is_float_dtype(workspace.dtype())) {
    fail(
        kOp,
        "workspace must be a 1-D float array, got shape ",
        shape_str(workspace.shape()),
        " of ",
        dtype_str(workspace.dtype()),
        ".");
  }
  check_triple_arrays(kOp, "", "N", packed, scales, biases);
  const int64_t D = int64_t(packed.shape(3)) * 32 / bits;
  if (int64_t(packed.shape(3)) * 32 % bits != 0 || D % group_size != 0 ||
      scales.shape(3) != D / group_size) {
    fail(
        kOp,
        "packed shape ",
        shape_str(packed.shape()),
        " and scales shape ",
        shape_str(scales.shape()),
        " do not describe ",
        bits,
        "-bit codes in groups of ",
        group_size,
        ".");
  }
  const int64_t need = int64_t(packed.shape(0)) * packed.shape(1) * packed.shape(2) * D;
  if (int64_t(workspace.size()) < need) {
    fail(
        kOp,
        "workspace holds ",
        int64_t(workspace.size()),
        " elements but the dequantized [B, H, N, D] needs ",
        need,
        ".");
  }
  std::vector<mx::array> inputs{workspace, packed, scales, biases};
  inputs.insert(inputs.end(), after.begin(), after.end());
  auto primitive = std::make_shared<DequantizeInto>(mx::to_stream(s), group_size, bits);
  auto shape = primitive->output_shapes(inputs)[0];
  return mx::array(std::move(shape), workspace.dtype(), std::move(primitive), std::move(inputs));
}

} // namespace mlxq
