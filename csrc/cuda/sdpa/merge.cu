// The split merge of the generic and tiled kernels (and of decode when its
// fused merge is off): the splits' partial (o, max, sum) of every query row
// combined by log-sum-exp, sinks applied, written in the query's dtype. It
// takes the attention kernel's own SdpaArgs (partials, sizes, row tiles).
#include <cfloat>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

// Grid (B x Hkv x rows, ceil(Dv / 32)): one block per output row and 32
// columns (lane = column); warp w folds splits w, w + 8, ... so the loads of
// many splits are in flight at once, and the warps' states are folded in
// shared memory.
constexpr int kMergeWarps = kMergeThreads / 32;

__global__ void __launch_bounds__(kMergeWarps * 32) merge_kernel_impl(SdpaArgs a) {
  __shared__ float red_m[kMergeWarps], red_l[kMergeWarps];
  __shared__ float cols[kMergeWarps][32];
  const int row = blockIdx.x;
  const int r = row % a.rows;
  const int bk = row / a.rows; // b * Hkv + kvh
  const int kvh = bk % a.Hkv, b = bk / a.Hkv;
  const int tile = r / a.row_tile, rr = r % a.row_tile;
  const int l = row_position(r, a.rep), h = row_head(kvh, r, a.rep);
  auto slot = [&](int split) {
    return ((int64_t(bk) * a.row_tiles + tile) * a.splits + split) * a.row_tile + rr;
  };
  // One pass: each warp folds its splits (every kMergeWarps-th) into a
  // running (max, sum, output column) by log-sum-exp, then warp 0 folds the
  // warps' states. (Three dependent passes over the partials cost more
  // latency than the arithmetic saved.)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d = blockIdx.y * 32 + lane;
  const bool col = d < a.Dv;
  float m = -INFINITY, lsum = 0.0f, o = 0.0f;
#pragma unroll 4
  for (int s = warp; s < a.splits; s += kMergeWarps) {
    const float ms = a.part_ml[slot(s) * 2];
    const float ls = a.part_ml[slot(s) * 2 + 1];
    const float os = col ? a.part_o[slot(s) * a.Dv + d] : 0.0f;
    if (ms != -INFINITY) {
      const float mn = fmaxf(m, ms);
      const float keep = expf(m - mn), add = expf(ms - mn); // m = -inf: keep = 0
      lsum = lsum * keep + ls * add;
      o = o * keep + os * add;
      m = mn;
    }
  }
  red_m[warp] = m; // the same in every lane of a warp
  red_l[warp] = lsum;
  cols[warp][lane] = o;
  __syncthreads();
  if (warp == 0 && col) {
    float mb = -INFINITY;
    for (int w = 0; w < kMergeWarps; ++w)
      mb = fmaxf(mb, red_m[w]);
    float lb = 0.0f, ob = 0.0f;
    if (mb != -INFINITY) {
      for (int w = 0; w < kMergeWarps; ++w) {
        if (red_m[w] != -INFINITY) {
          const float f = expf(red_m[w] - mb);
          lb += red_l[w] * f;
          ob += cols[w][lane] * f;
        }
      }
    }
    const float* sink = a.sinks ? a.sinks + h : nullptr;
    const float inv = output_scale(mb, lb, sink);
    const int64_t out = ((int64_t(b) * a.Hq + h) * a.L + l) * a.Dv + d;
    store_float(a.out, out, a.q_dtype, ob * inv);
    if (a.lse && d == 0) {
      a.lse[(int64_t(b) * a.Hq + h) * a.L + l] = log_denominator(mb, lb, sink);
    }
  }
}

} // namespace

void* merge_kernel() {
  return handle<merge_kernel_impl>();
}

} // namespace mlxq::cuda
