#include "prefix_view.h"

namespace mlxq::detail {

void set_prefix_view(const mx::array& full, mx::array& view) {
  const auto& st = full.strides();
  if (view.size() == 0) { // as MLX's slice makes an empty array
    auto flags = full.flags();
    flags.contiguous = flags.row_contiguous = flags.col_contiguous = true;
    view.copy_shared_buffer(full, st, flags, 0);
    return;
  }
  // The span from the first element to one past the last.
  int64_t end = 1;
  bool row = true;
  int64_t dense = 1;
  int wide_dims = 0;
  for (int d = view.ndim() - 1; d >= 0; --d) {
    if (view.shape(d) > 1) {
      end += int64_t(view.shape(d) - 1) * st[d];
      row = row && st[d] == dense;
      ++wide_dims;
    }
    dense *= view.shape(d);
  }
  auto flags = full.flags();
  flags.row_contiguous = row;
  flags.col_contiguous = row && wide_dims <= 1;
  flags.contiguous = size_t(end) == view.size();
  view.copy_shared_buffer(full, st, flags, size_t(end));
}

std::vector<mx::array>
with_prefix_rows(const std::vector<mx::array>& inputs, int first, int count, int rows) {
  if (rows < 0) {
    return inputs;
  }
  std::vector<mx::array> out = inputs;
  for (int i = first; i < first + count; ++i) {
    const mx::array& full = inputs[i];
    auto shape = full.shape();
    shape[2] = rows;
    mx::array view(std::move(shape), full.dtype(), nullptr, {});
    set_prefix_view(full, view);
    out[i] = std::move(view);
  }
  return out;
}

mx::array row_range(const mx::array& a, int lo, int hi, mx::StreamOrDevice s) {
  if (lo == 0 && hi == a.shape(2)) {
    return a;
  }
  return mx::slice(a, {0, 0, lo, 0}, {a.shape(0), a.shape(1), hi, a.shape(3)}, s);
}

} // namespace mlxq::detail
