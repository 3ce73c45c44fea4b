// CUDA QuantizedSDPA, generic kernel: every option the tensor-core kernels
// (sdpa/decode.cuh, sdpa/tiled.cuh) do not take.
//
// One block (128 threads) attends `row_tile` (<= 16) query rows of one KV head
// (its query heads x query positions) over one split of the keys, in tiles of
// 32 keys:
//   1. the tile's packed K and V rows are copied to shared memory with 16-byte
//      coalesced loads (4-byte loads when a view's strides forbid it), with
//      their scales and biases;
//   2. every code is dequantized once, into f32 shared memory, for all rows;
//   3. scores: thread (key j, rows r = t/32 + 4k) does float4 dot products of
//      the tile's K row with the query rows (queries are broadcast reads);
//   4. an online softmax per row, one warp per row (a tile is one warp wide);
//   5. values: thread t owns output columns t + 128c of every row and keeps
//      them in registers across all tiles.
// Grid: (Hkv x row_tiles, splits, B): the row tiles go in x, whose limit is
// 2^31 - 1 (y and z stop at 65535). Decode uses many splits so that every
// SM has work at any N; each writes an unnormalised partial (o, max, sum) and
// merge_kernel (sdpa/merge.cu) combines them by log-sum-exp. Prefill (many rows) uses one
// split: row tiles alone fill the GPU, and a causal row tile stops at its
// last visible key, so fully hidden tiles are never read.
#include <cfloat>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

constexpr int TK = kTileKeys;
constexpr int RT = kMaxTileRows;
constexpr int NT = kBlockThreads;
constexpr int kMaxDvPerThread = 512 / NT; // output columns per thread

struct Smem {
  float* q; // [RT][Dk]
  float* k; // [TK][Dk + 4]
  float* v; // [TK][Dv]
  uint32_t* kraw; // [TK][Wk]
  uint32_t* vraw; // [TK][Wv]
  float* ksb; // [TK][Gk][2] scale, bias
  float* vsb; // [TK][Gv][2]
  float* s; // [RT][TK] scores, then probabilities
  float* m; // [RT] running max
  float* l; // [RT] running sum
  float* corr; // [RT] rescale of this tile
};

__host__ __device__ inline int round4(int x) {
  return (x + 3) & ~3;
}

__host__ __device__ inline int
smem_floats(int Dk, int Dv, int k_bits, int v_bits, Smem* out, void* base) {
  const int Wk = Dk * k_bits / 32, Wv = Dv * v_bits / 32;
  const int sizes[] = {
      RT * Dk,
      TK * (Dk + 4),
      TK * Dv,
      round4(TK * Wk),
      round4(TK * Wv),
      round4(TK * (Dk / 32) * 2),
      round4(TK * (Dv / 32) * 2),
      RT * TK,
      RT,
      RT,
      RT};
  int total = 0;
  float* p = static_cast<float*>(base);
  for (int i = 0; i < 11; ++i) {
    if (out) {
      float* at = p + total;
      switch (i) {
        case 0:
          out->q = at;
          break;
        case 1:
          out->k = at;
          break;
        case 2:
          out->v = at;
          break;
        case 3:
          out->kraw = reinterpret_cast<uint32_t*>(at);
          break;
        case 4:
          out->vraw = reinterpret_cast<uint32_t*>(at);
          break;
        case 5:
          out->ksb = at;
          break;
        case 6:
          out->vsb = at;
          break;
        case 7:
          out->s = at;
          break;
        case 8:
          out->m = at;
          break;
        case 9:
          out->l = at;
          break;
        default:
          out->corr = at;
          break;
      }
    }
    total += round4(sizes[i]);
  }
  return total;
}

__device__ inline int64_t off3(const int64_t* st, int64_t a, int64_t b, int64_t c) {
  return a * st[0] + b * st[1] + c * st[2];
}

// Copies the packed rows and group parameters of keys [c0, c0 + TK) (those
// below n1) of one KV head into shared memory.
__device__ void load_tile_raw(
    const uint32_t* w,
    const int64_t* wst,
    const void* sc,
    const int64_t* sst,
    const void* bi,
    const int64_t* bst,
    int s_dtype,
    int b,
    int h,
    int c0,
    int n1,
    int W,
    int G,
    int vec,
    uint32_t* raw,
    float* sb) {
  const int t = threadIdx.x;
  if (vec) {
    const int W4 = W / 4;
    for (int idx = t; idx < TK * W4; idx += NT) {
      const int j = idx / W4, w4 = (idx % W4) * 4;
      const int n = c0 + j;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (n < n1) {
        val = *reinterpret_cast<const uint4*>(w + off3(wst, b, h, n) + w4);
      }
      *reinterpret_cast<uint4*>(raw + j * W + w4) = val;
    }
  } else {
    for (int idx = t; idx < TK * W; idx += NT) {
      const int j = idx / W, wi = idx % W;
      const int n = c0 + j;
      raw[j * W + wi] = n < n1 ? w[off3(wst, b, h, n) + wi * wst[3]] : 0u;
    }
  }
  for (int idx = t; idx < TK * G; idx += NT) {
    const int j = idx / G, g = idx % G;
    const int n = c0 + j;
    float s = 0.0f, bb = 0.0f;
    if (n < n1) {
      s = load_float(sc, off3(sst, b, h, n) + g * sst[3], s_dtype);
      bb = load_float(bi, off3(bst, b, h, n) + g * bst[3], s_dtype);
    }
    sb[2 * idx] = s;
    sb[2 * idx + 1] = bb;
  }
}

// Dequantizes the staged tile into f32 rows of `stride` floats (rows of keys
// past n1 become 0, so they add nothing to the outputs).
template <int BITS>
__device__ void dequant_tile(
    const uint32_t* raw,
    const float* sb,
    int D,
    int W,
    int G,
    int gs,
    float* dst,
    int stride) {
  for (int idx = threadIdx.x; idx < TK * D; idx += NT) {
    const int j = idx / D, i = idx % D;
    const float* p = sb + 2 * (j * G + i / gs);
    const float code = static_cast<float>(extract_code<BITS>(raw + j * W, i));
    dst[j * stride + i] = code * p[0] + p[1];
  }
}

// Keys and values have their own widths (KBITS, VBITS) and group sizes.
template <int KBITS, int VBITS>
__global__ void __launch_bounds__(NT) generic_kernel_impl(SdpaArgs a) {
  extern __shared__ float4 smem_raw[];
  Smem sm;
  smem_floats(a.Dk, a.Dv, KBITS, VBITS, &sm, smem_raw);

  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int split = blockIdx.y;
  const int tile = blockIdx.x % a.row_tiles, kvh = blockIdx.x / a.row_tiles;
  const int b = blockIdx.z;
  const int r0 = tile * a.row_tile;
  const int R = min(a.row_tile, a.rows - r0);
  const int Dk = a.Dk, Dv = a.Dv;
  const int Wk = Dk * KBITS / 32, Wv = Dv * VBITS / 32;
  const int Gk = Dk / a.k_group_size, Gv = Dv / a.v_group_size;
  const int n0 = split * a.split_keys;
  int n1 = min(n0 + a.split_keys, a.N);
  if (a.mask_kind == kMaskCausal) {
    const int last_l = row_position(r0 + R - 1, a.rep);
    n1 = min(n1, last_l + a.N - a.L + 1);
  }

  for (int idx = t; idx < R * Dk; idx += NT) {
    const int r = idx / Dk, i = idx % Dk;
    const int l = row_position(r0 + r, a.rep), h = row_head(kvh, r0 + r, a.rep);
    const int64_t off = b * a.q_st[0] + h * a.q_st[1] + l * a.q_st[2] + i * a.q_st[3];
    sm.q[r * Dk + i] = load_float(a.q, off, a.q_dtype) * a.scale;
  }
  if (t < RT) {
    sm.m[t] = -INFINITY;
    sm.l[t] = 0.0f;
  }
  float acc[kMaxDvPerThread][RT];
#pragma unroll
  for (int c = 0; c < kMaxDvPerThread; ++c) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      acc[c][r] = 0.0f;
    }
  }
  __syncthreads();

  for (int c0 = n0; c0 < n1; c0 += TK) {
    load_tile_raw(
        a.kw,
        a.kw_st,
        a.ks,
        a.ks_st,
        a.kb,
        a.kb_st,
        a.scale_dtype,
        b,
        kvh,
        c0,
        n1,
        Wk,
        Gk,
        a.vec_loads,
        sm.kraw,
        sm.ksb);
    load_tile_raw(
        a.vw,
        a.vw_st,
        a.vs,
        a.vs_st,
        a.vb,
        a.vb_st,
        a.scale_dtype,
        b,
        kvh,
        c0,
        n1,
        Wv,
        Gv,
        a.vec_loads,
        sm.vraw,
        sm.vsb);
    __syncthreads();
    dequant_tile<KBITS>(sm.kraw, sm.ksb, Dk, Wk, Gk, a.k_group_size, sm.k, Dk + 4);
    dequant_tile<VBITS>(sm.vraw, sm.vsb, Dv, Wv, Gv, a.v_group_size, sm.v, Dv);
    __syncthreads();

    // Scores with masks.
    {
      const int j = lane, n = c0 + j;
      float sc[RT / 4];
#pragma unroll
      for (int k = 0; k < RT / 4; ++k) {
        sc[k] = 0.0f;
      }
      const float* krow = sm.k + j * (Dk + 4);
      for (int i = 0; i < Dk; i += 4) {
        const float4 kv = *reinterpret_cast<const float4*>(krow + i);
#pragma unroll
        for (int k = 0; k < RT / 4; ++k) {
          const int r = warp + 4 * k;
          if (r < R) {
            const float4 qv = *reinterpret_cast<const float4*>(sm.q + r * Dk + i);
            sc[k] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < RT / 4; ++k) {
        const int r = warp + 4 * k;
        if (r < R) {
          const int l = row_position(r0 + r, a.rep), h = row_head(kvh, r0 + r, a.rep);
          float s = sc[k];
          if (n >= n1) {
            s = -INFINITY;
          } else if (a.mask_kind == kMaskCausal) {
            if (n > l + a.N - a.L) {
              s = -INFINITY;
            }
          } else if (a.mask_kind == kMaskArray) {
            const int64_t mo = b * a.m_st[0] + h * a.m_st[1] + l * a.m_st[2] + n * a.m_st[3];
            const float mv = load_float(a.mask, mo, a.mask_dtype);
            if (a.mask_dtype == kBool) {
              s = mv != 0.0f ? s : -INFINITY;
            } else {
              s += mv;
            }
          }
          sm.s[r * TK + j] = s;
        }
      }
    }
    __syncthreads();

    // Online softmax, one warp per row.
    for (int r = warp; r < R; r += 4) {
      const float s = sm.s[r * TK + lane];
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, warp_max(s));
      float p = 0.0f, corr = 1.0f;
      if (m_new != -INFINITY) {
        p = s == -INFINITY ? 0.0f : expf(s - m_new);
        corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
      }
      const float sum = warp_sum(p);
      sm.s[r * TK + lane] = p;
      // Every lane has read m[r] (m_old) above; the shuffles alone do not
      // order shared memory, so the warp meets before lane 0 overwrites it.
      __syncwarp();
      if (lane == 0) {
        sm.l[r] = sm.l[r] * corr + sum;
        sm.m[r] = m_new;
        sm.corr[r] = corr;
      }
    }
    __syncthreads();

    // Values: registers hold columns t + 128c of every row.
#pragma unroll
    for (int c = 0; c < kMaxDvPerThread; ++c) {
      const int d = t + NT * c;
      if (d < Dv) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          if (r < R) {
            acc[c][r] *= sm.corr[r];
          }
        }
        for (int j = 0; j < TK; ++j) {
          const float v = sm.v[j * Dv + d];
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            if (r < R) {
              // A key no row attends (p == 0) adds nothing, even if its
              // value row is not finite.
              const float p = sm.s[r * TK + j];
              acc[c][r] += p != 0.0f ? p * v : 0.0f;
            }
          }
        }
      }
    }
    __syncthreads();
  }

  // Write the output (one split) or this split's partial.
  const int64_t blk = ((int64_t(b) * a.Hkv + kvh) * a.row_tiles + tile) * a.splits + split;
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    if (r >= R) {
      continue;
    }
    const float m = sm.m[r], lsum = sm.l[r];
    const int l = row_position(r0 + r, a.rep), h = row_head(kvh, r0 + r, a.rep);
    const float inv = output_scale(m, lsum, a.sinks ? a.sinks + h : nullptr);
#pragma unroll
    for (int c = 0; c < kMaxDvPerThread; ++c) {
      const int d = t + NT * c;
      if (d < Dv) {
        if (a.splits == 1 && !a.lse) {
          const int64_t o = ((int64_t(b) * a.Hq + h) * a.L + l) * Dv + d;
          store_float(a.out, o, a.q_dtype, acc[c][r] * inv);
        } else {
          a.part_o[(blk * a.row_tile + r) * Dv + d] = acc[c][r];
        }
      }
    }
    if ((a.splits > 1 || a.lse) && t == 0) {
      a.part_ml[(blk * a.row_tile + r) * 2] = m;
      a.part_ml[(blk * a.row_tile + r) * 2 + 1] = lsum;
    }
  }
}

} // namespace

int generic_smem_bytes(int Dk, int Dv, int k_bits, int v_bits) {
  return smem_floats(Dk, Dv, k_bits, v_bits, nullptr, nullptr) * int(sizeof(float));
}

namespace {

template <int KBITS>
void* generic_for_values(int v_bits) {
  switch (v_bits) {
    case 2:
      return handle<generic_kernel_impl<KBITS, 2>>();
    case 3:
      return handle<generic_kernel_impl<KBITS, 3>>();
    case 4:
      return handle<generic_kernel_impl<KBITS, 4>>();
    case 5:
      return handle<generic_kernel_impl<KBITS, 5>>();
    case 6:
      return handle<generic_kernel_impl<KBITS, 6>>();
    default:
      return handle<generic_kernel_impl<KBITS, 8>>();
  }
}

} // namespace

void* generic_kernel(int k_bits, int v_bits) {
  switch (k_bits) {
    case 2:
      return generic_for_values<2>(v_bits);
    case 3:
      return generic_for_values<3>(v_bits);
    case 4:
      return generic_for_values<4>(v_bits);
    case 5:
      return generic_for_values<5>(v_bits);
    case 6:
      return generic_for_values<6>(v_bits);
    default:
      return generic_for_values<8>(v_bits);
  }
}

} // namespace mlxq::cuda
