// The split merge of the decode kernel, done by the last of a (batch, KV
// head)'s blocks to finish instead of by a second kernel.
//
// Why: at decode sizes merge_kernel is a few microseconds of launch gap and
// L2 latency behind a ~50 us kernel; here the other blocks' partials are
// folded while the slowest blocks of other heads still stream.
//
// Each block publishes its partial (plain stores, then a fence) and takes a
// ticket from a per-(batch, KV head) counter with atomicInc, which wraps to
// 0 at the last ticket: the counter is zero again for the next launch, and
// the host zeroes fresh counters once per evaluation.
#pragma once

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

// True in every thread of the block that took the last ticket of its
// (batch, KV head); that block then sees every split's partial.
__device__ inline bool last_block_of_head(unsigned* counter, int splits) {
  __shared__ int is_last;
  __threadfence(); // this thread's partial stores are visible device-wide
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicInc(counter, unsigned(splits - 1)) == unsigned(splits - 1);
  }
  __syncthreads();
  if (is_last) {
    __threadfence(); // order the other blocks' partials before our reads
  }
  return is_last;
}

// Folds the splits' partials of one (batch b, KV head kvh) into `out` by
// log-sum-exp (the same numerics as merge_kernel). Partials are laid out as
// the decode kernel writes them: block (b, kvh, split) at
// blk = (b * Hkv + kvh) * splits + split, o at [blk][row][Dv], (max in
// natural-log units, sum) at [blk][row][2]. `wsm` is shared scratch of
// splits * rows + rows floats.
template <int kThreads>
__device__ void merge_head_splits(const SdpaArgs& a, int b, int kvh, float* wsm) {
  const int R = a.rows, S = a.splits, Dv = a.Dv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = (int64_t(b) * a.Hkv + kvh) * S * R; // (blk * R + row) of split 0
  float* row_scale = wsm + S * R;
  // Per row (one warp each): the max over splits, each split's weight
  // exp(m_s - max) into shared memory, and the output's normaliser.
  for (int r = warp; r < R; r += kThreads / 32) {
    float mx = -INFINITY;
    for (int s = lane; s < S; s += 32) {
      mx = fmaxf(mx, __ldcg(a.part_ml + (row0 + int64_t(s) * R + r) * 2));
    }
    mx = warp_max(mx);
    float lsum = 0.0f;
    for (int s = lane; s < S; s += 32) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(a.part_ml) + row0 + s * R + r);
      const float w = ml.x == -INFINITY ? 0.0f : expf(ml.x - mx);
      lsum += w * ml.y;
      wsm[s * R + r] = w;
    }
    lsum = warp_sum(lsum);
    if (lane == 0) {
      const int h = row_head(kvh, r, a.rep);
      const float* sink = a.sinks ? a.sinks + h : nullptr;
      row_scale[r] = output_scale(mx, lsum, sink);
      if (a.lse) {
        const int l = row_position(r, a.rep);
        a.lse[(int64_t(b) * a.Hq + h) * a.L + l] = log_denominator(mx, lsum, sink);
      }
    }
  }
  __syncthreads();
  // Four output columns per thread and step; the splits' loads of one
  // thread are independent, so many are in flight at once.
  const int quads = R * Dv / 4;
  for (int i = threadIdx.x; i < quads; i += kThreads) {
    const int r = 4 * i / Dv, d = 4 * i % Dv;
    const float4* src = reinterpret_cast<const float4*>(a.part_o + (row0 + r) * Dv + d);
    const int64_t step = int64_t(R) * Dv / 4; // float4s from one split to the next
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int s = 0; s < S; ++s) {
      const float w = wsm[s * R + r];
      const float4 v = __ldcg(src + s * step);
      o.x = fmaf(w, v.x, o.x);
      o.y = fmaf(w, v.y, o.y);
      o.z = fmaf(w, v.z, o.z);
      o.w = fmaf(w, v.w, o.w);
    }
    const float sc = row_scale[r];
    const int l = row_position(r, a.rep), h = row_head(kvh, r, a.rep);
    const int64_t out = ((int64_t(b) * a.Hq + h) * a.L + l) * Dv + d;
    store_float(a.out, out, a.q_dtype, o.x * sc);
    store_float(a.out, out + 1, a.q_dtype, o.y * sc);
    store_float(a.out, out + 2, a.q_dtype, o.z * sc);
    store_float(a.out, out + 3, a.q_dtype, o.w * sc);
  }
}

} // namespace mlxq::cuda
