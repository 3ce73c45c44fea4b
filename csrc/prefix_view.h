// Views of a buffer's first rows along axis 2, made at eval time: a KV
// cache's fetch of rows [0, n) of its [B, H, S, W] buffers without a slice
// node in the graph.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace mlxq::detail {

namespace mx = mlx::core;

// Makes `view` (shaped [B, H, n, W], n <= S, no data yet) share `full`'s
// memory from its first element, with the flags mx::slice would give it.
void set_prefix_view(const mx::array& full, mx::array& view);

// `inputs` with entries [first, first + count) replaced by views of their
// rows [0, rows); `inputs` itself when rows < 0.
std::vector<mx::array>
with_prefix_rows(const std::vector<mx::array>& inputs, int first, int count, int rows);

// Rows [lo, hi) of a [B, H, S, W] buffer as a graph slice; `a` itself when
// that is every row.
mx::array row_range(const mx::array& a, int lo, int hi, mx::StreamOrDevice s);

} // namespace mlxq::detail
