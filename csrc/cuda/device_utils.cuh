// Small device helpers shared by mlxq's CUDA kernels (no MLX headers here:
// nvcc cannot parse them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/kernel_args.h"

namespace mlxq::cuda {

// The driver handle of one of our kernels: MLX's launch API takes CUfunction
// handles, and libmlx's static runtime does not know our kernels' symbols.
// Looked up once per kernel (every evaluation asks for it).
template <auto Kernel>
void* handle() {
  static void* const fn = [] {
    cudaFunction_t f = nullptr;
    cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(Kernel));
    return reinterpret_cast<void*>(f);
  }();
  return fn;
}

// Query row r of a KV head's rows (its rep query heads x the positions, head
// fastest): its position and its query head.
__device__ __forceinline__ int row_position(int r, int rep) {
  return r / rep;
}
__device__ __forceinline__ int row_head(int kvh, int r, int rep) {
  return kvh * rep + r % rep;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// d += a . b on m16n8k16 tiles, T = __half or __nv_bfloat16 operands.
template <typename T>
__device__ __forceinline__ void
mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to a T pair (f16 or bf16), as the 32-bit register an
// mma fragment takes.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// x - bf16(x) for a pair packed by pack2<bf16>: the low term of a split.
__device__ __forceinline__ uint32_t bf16_rest(float x, float y, uint32_t hi) {
  const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&hi);
  const float2 f = __bfloat1622float2(h);
  return pack2<__nv_bfloat16>(x - f.x, y - f.y);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// BYTES (16 or 4) global -> shared, asynchronously: no registers are held
// while the copy is in flight. 16-byte copies bypass L1 (.cg); 4-byte ones
// cannot (.ca).
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 16 or 4 bytes here");
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
  }
}

// The same to a shared address, reading only the first `bytes` and
// zero-filling the rest (0: nothing is read, but `src` must still be a
// valid address).
template <int BYTES>
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, int bytes) {
  static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 16 or 4 bytes here");
  if constexpr (BYTES == 16) {
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
  }
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Waits for every copy issued so far, committed or not.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::);
}

// Waits for `threads` threads (whole warps) at barrier `id` (1-15; 0 is
// __syncthreads'), so a few warps can meet without stopping the others.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Four 8x8 matrices of 16-bit values from shared memory (lane i gives the
// address of row i % 8 of matrix i / 8), as mma fragments; .trans
// transposes each.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ float load_float(const void* base, int64_t i, int dtype) {
  switch (dtype) {
    case kF16:
      return __half2float(static_cast<const __half*>(base)[i]);
    case kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case kBool:
      return static_cast<const bool*>(base)[i] ? 1.0f : 0.0f;
    default:
      return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store_float(void* base, int64_t i, int dtype, float v) {
  switch (dtype) {
    case kF16:
      static_cast<__half*>(base)[i] = __float2half(v);
      break;
    case kBF16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
      break;
  }
}

// Folds v over the lanes that differ only in lane bits kFirst..kLast
// (powers of two, ascending) with op: an mma fragment's quad (1, 2), its rows
// across quads (4, 8, 16), or the whole warp (1 .. 16).
template <int kFirst, int kLast, typename Op>
__device__ __forceinline__ float lanes_fold(float v, Op op) {
#pragma unroll
  for (int o = kFirst; o <= kLast; o <<= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

template <int kFirst, int kLast>
__device__ __forceinline__ float lanes_sum(float v) {
  return lanes_fold<kFirst, kLast>(v, [](float x, float y) { return x + y; });
}

template <int kFirst, int kLast>
__device__ __forceinline__ float lanes_max(float v) {
  return lanes_fold<kFirst, kLast>(v, [](float x, float y) { return fmaxf(x, y); });
}

// Whole-warp folds, halves first (the order the kernels were validated with).
template <typename Op>
__device__ __forceinline__ float warp_fold(float v, Op op) {
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  return warp_fold(v, [](float x, float y) { return fmaxf(x, y); });
}

__device__ __forceinline__ float warp_min(float v) {
  return warp_fold(v, [](float x, float y) { return fminf(x, y); });
}

__device__ __forceinline__ float warp_sum(float v) {
  return warp_fold(v, [](float x, float y) { return x + y; });
}

// The factor that turns a row's unnormalised output (weights relative to its
// running max m, summing to lsum) into attention output, with an optional
// sink logit in the denominator. A row that saw no key gets 0.
__device__ inline float output_scale(float m, float lsum, const float* sink) {
  if (sink) {
    const float mm = fmaxf(m, *sink);
    const float carried = m == -INFINITY ? 0.0f : expf(m - mm);
    const float denom = lsum * carried + expf(*sink - mm);
    return denom > 0.0f ? carried / denom : 0.0f;
  }
  return lsum > 0.0f ? 1.0f / lsum : 0.0f;
}

// A row's log-sum-exp (natural log of its softmax denominator, the sink
// included) from its max m (natural units) and sum; -inf when empty.
__device__ inline float log_denominator(float m, float lsum, const float* sink) {
  const float mm = sink ? fmaxf(m, *sink) : m;
  if (mm == -INFINITY) {
    return -INFINITY;
  }
  float denom = m == -INFINITY ? 0.0f : lsum * expf(m - mm);
  if (sink) {
    denom += expf(*sink - mm);
  }
  return denom > 0.0f ? mm + logf(denom) : -INFINITY;
}

// Code i of a row of MLX-packed codes (one little-endian bit stream).
template <int BITS>
__device__ __forceinline__ uint32_t extract_code(const uint32_t* words, int i) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  const int bit = i * BITS;
  const int word = bit >> 5;
  const int off = bit & 31;
  uint32_t v = words[word] >> off;
  if constexpr (32 % BITS != 0) {
    if (off + BITS > 32) {
      v |= words[word + 1] << (32 - off);
    }
  }
  return v & mask;
}

} // namespace mlxq::cuda
