// CUDA RecentAttention: one block of kWindowWarps warps per query row. Each
// warp runs an online softmax over every kWindowWarps-th window key: a
// chain of dependent loads, so the warps are many (a 129-key window is 9
// keys per warp) and each key's value row is fetched with its key (a
// warp-wide dot product per key; each lane owns head dims lane + 32 i of the
// output), then the warps' states fold in shared memory and the row is
// merged with the quantized part's output by log-sum-exp.
#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

constexpr int kMaxDim = 512; // kWindowMaxHeadDim
constexpr int kChunks = kMaxDim / 32;

__global__ void __launch_bounds__(kWindowWarps * 32) window_kernel_impl(WindowArgs a) {
  const int row = blockIdx.x;
  const int l = row % a.L;
  const int h = (row / a.L) % a.Hq;
  const int b = row / (a.L * a.Hq);
  const int kvh = h / a.rep;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float q[kMaxDim];
  __shared__ float fold_m[kWindowWarps], fold_sum[kWindowWarps];
  __shared__ float fold_acc[kWindowWarps][kMaxDim];

  const int64_t q0 = b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2];
  for (int d = threadIdx.x; d < a.Dk; d += blockDim.x) {
    q[d] = a.scale * load_float(a.q, q0 + d * a.q_st[3], a.dtype);
  }
  __syncthreads();

  const int visible = a.causal ? min(a.T, l + a.T - a.L + 1) : a.T;
  float m = -INFINITY, sum = 0.0f, acc[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    acc[i] = 0.0f;
  }
  for (int j = warp; j < visible; j += kWindowWarps) {
    // The key's value row is loaded before the score's reduction, so its
    // latency overlaps the key's (each warp's keys are a dependent chain).
    const int64_t k0 = b * a.k_st[0] + kvh * a.k_st[1] + j * a.k_st[2];
    const int64_t v0 = b * a.v_st[0] + kvh * a.v_st[1] + j * a.v_st[2];
    float vrow[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int d = lane + 32 * i;
      vrow[i] = d < a.Dv ? load_float(a.v, v0 + d * a.v_st[3], a.dtype) : 0.0f;
    }
    float s = 0.0f;
    for (int d = lane; d < a.Dk; d += 32) {
      s += q[d] * load_float(a.k, k0 + d * a.k_st[3], a.dtype);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float carry = expf(m - m_new); // 0 at the first key (m = -inf)
    const float p = expf(s - m_new);
    sum = sum * carry + p;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      acc[i] = acc[i] * carry + p * vrow[i];
    }
    m = m_new;
  }
  if (lane == 0) {
    fold_m[warp] = m;
    fold_sum[warp] = sum;
  }
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < a.Dv) {
      fold_acc[warp][d] = acc[i];
    }
  }
  __syncthreads();

  // Fold the warps (a warp that saw no key has m = -inf: weight 0; every
  // row sees at least one key, so the row max is finite).
  float mw = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWindowWarps; ++w) {
    mw = fmaxf(mw, fold_m[w]);
  }
  float sw = 0.0f, scale_w[kWindowWarps];
#pragma unroll
  for (int w = 0; w < kWindowWarps; ++w) {
    scale_w[w] = expf(fold_m[w] - mw);
    sw += fold_sum[w] * scale_w[w];
  }
  const float lw = mw + logf(sw);
  const float lq = a.lse_q[b * a.l_st[0] + h * a.l_st[1] + l * a.l_st[2]];
  const float lse = fmaxf(lq, lw) + log1pf(expf(-fabsf(lq - lw)));
  const float wq = expf(lq - lse); // 0 where the quantized part saw no key
  const float ww = expf(mw - lse);
  const int64_t o0 = b * a.o_st[0] + h * a.o_st[1] + l * a.o_st[2];
  const int64_t dst = ((int64_t(b) * a.Hq + h) * a.L + l) * a.Dv;
  for (int d = threadIdx.x; d < a.Dv; d += blockDim.x) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWindowWarps; ++w) {
      v += fold_acc[w][d] * scale_w[w];
    }
    const float o = wq * load_float(a.out_q, o0 + d * a.o_st[3], a.dtype) + ww * v;
    store_float(a.out, dst + d, a.dtype, o);
  }
}

} // namespace

void* window_kernel() {
  return handle<window_kernel_impl>();
}

} // namespace mlxq::cuda
