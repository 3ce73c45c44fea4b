// The GEMM family's own kernels (the GEMMs are cuBLAS's, launched by
// cuda/gemm_sdpa.cpp): the query copied into the GEMM's row order where it is
// strided, the online-softmax fold of one block of scores, and the final
// normalisation into the output.
#include <cfloat>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

constexpr int kWarps = kGemmThreads / 32;
constexpr int kPasses = kGemmMaxBlockKeys / (kGemmThreads * 4);

// Grid-stride copy of a strided [B, Hq, L, D] query of 16-bit elements into
// a contiguous one, 8 elements (16 bytes) per step where the layout allows.
__global__ void __launch_bounds__(kGemmThreads) gather_kernel(GemmGatherArgs a) {
  const int step = a.vec ? 8 : 1;
  const int64_t n = a.total / step;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = c * step;
    const int d = int(i % a.D);
    const int64_t row = i / a.D; // (b * Hq + h) * L + l
    const int l = int(row % a.L);
    const int64_t bh = row / a.L;
    const int h = int(bh % a.Hq);
    const int64_t b = bh / a.Hq;
    const int64_t src = b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2] + d * a.q_st[3];
    if (a.vec) {
      reinterpret_cast<uint4*>(a.dst)[c] =
          reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.q) + src)[0];
    } else {
      static_cast<uint16_t*>(a.dst)[i] = static_cast<const uint16_t*>(a.q)[src];
    }
  }
}

// Block-wide fold of v (every thread gets the result); `red` holds one value
// per warp.
template <typename Op>
__device__ float block_fold(float v, float* red, Op op) {
  v = warp_fold(v, op);
  __syncthreads(); // red may still be read from the previous fold
  if ((threadIdx.x & 31) == 0) {
    red[threadIdx.x >> 5] = v;
  }
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    r = op(r, red[w]);
  }
  return r;
}

// One block per row of one (batch, KV head) and key block. Each thread holds
// up to kPasses x 4 scores in registers: every score is read before any
// weight is written over the row (the weights alias the scores' bytes).
template <typename T>
__global__ void __launch_bounds__(kGemmThreads) fold_kernel(GemmFoldArgs a) {
  __shared__ float red[kWarps];
  const int64_t row = blockIdx.x; // g * rows + r
  const int r = int(row % a.rows);
  const int pos = r % a.L; // head-major rows
  float* srow = a.s + row * a.ld;
  // Keys up to this one are visible to the row (bottom-right causal).
  const int last = a.causal ? pos + a.N - a.L - a.n0 : a.keys - 1;
  const int visible = min(a.keys, last + 1);
  float v[kPasses][4];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int k = (i * kGemmThreads + threadIdx.x) * 4;
    float4 x = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    if (k < a.ld) {
      x = *reinterpret_cast<const float4*>(srow + k);
    }
    v[i][0] = k < visible ? x.x : -INFINITY;
    v[i][1] = k + 1 < visible ? x.y : -INFINITY;
    v[i][2] = k + 2 < visible ? x.z : -INFINITY;
    v[i][3] = k + 3 < visible ? x.w : -INFINITY;
    mx = fmaxf(mx, fmaxf(fmaxf(v[i][0], v[i][1]), fmaxf(v[i][2], v[i][3])));
  }
  mx = block_fold(mx, red, [](float x, float y) { return fmaxf(x, y); });
  const float m_old = a.first ? -INFINITY : a.m[row];
  const float m_new = fmaxf(m_old, mx);
  // A row that has seen no key yet keeps m = -inf and weights 0.
  const float base = m_new == -INFINITY ? 0.0f : m_new;
  const float corr = m_old == -INFINITY ? 0.0f : exp2f(m_old - base);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      v[i][c] = exp2f(v[i][c] - base); // -inf -> 0
      sum += v[i][c];
    }
  }
  sum = block_fold(sum, red, [](float x, float y) { return x + y; }); // all reads done
  T* prow = reinterpret_cast<T*>(srow);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int k = (i * kGemmThreads + threadIdx.x) * 4;
    if (k < a.ld) {
      uint2 w;
      w.x = pack2<T>(v[i][0], v[i][1]);
      w.y = pack2<T>(v[i][2], v[i][3]);
      *reinterpret_cast<uint2*>(prow + k) = w;
    }
  }
  if (threadIdx.x == 0) {
    a.m[row] = m_new;
    a.l[row] = (a.first ? 0.0f : a.l[row] * corr) + sum;
  }
  // The running output, summed over earlier blocks relative to m_old.
  if (!a.first && corr != 1.0f) {
    float4* orow = reinterpret_cast<float4*>(a.o + row * a.Dv);
    for (int d = threadIdx.x; d < a.Dv / 4; d += kGemmThreads) {
      float4 o = orow[d];
      o.x *= corr;
      o.y *= corr;
      o.z *= corr;
      o.w *= corr;
      orow[d] = o;
    }
  }
}

// One block per row: out = o / l, with the sink's weight in l (and, when
// asked, the row's log-sum-exp).
__global__ void __launch_bounds__(kGemmThreads) finish_kernel(GemmFinishArgs a) {
  const int64_t row = blockIdx.x;
  const int r = int(row % a.rows);
  const int64_t g = row / a.rows; // b * Hkv + kvh
  const int kvh = int(g % a.Hkv);
  const int64_t b = g / a.Hkv;
  const int l = r % a.L, h = kvh * a.rep + r / a.L;
  const float m = a.m[row] == -INFINITY ? -INFINITY : a.m[row] * kLn2;
  const float* sink = a.sinks ? a.sinks + h : nullptr;
  const float inv = output_scale(m, a.l[row], sink);
  if (a.lse && threadIdx.x == 0) {
    a.lse[(b * a.Hq + h) * a.L + l] = log_denominator(m, a.l[row], sink);
  }
  const float* orow = a.o + row * a.Dv;
  const int64_t out = ((b * a.Hq + h) * a.L + l) * a.Dv;
  for (int d = threadIdx.x; d < a.Dv; d += kGemmThreads) {
    store_float(a.out, out + d, a.out_dtype, orow[d] * inv);
  }
}

} // namespace

void* gemm_gather_kernel() {
  return handle<gather_kernel>();
}

void* gemm_fold_kernel(int q_dtype) {
  return q_dtype == kF16 ? handle<fold_kernel<__half>>() : handle<fold_kernel<__nv_bfloat16>>();
}

void* gemm_finish_kernel() {
  return handle<finish_kernel>();
}

} // namespace mlxq::cuda
