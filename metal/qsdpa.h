// The attention tile loop shared by the QuantizedSDPA decode and prefill
// kernels (qsdpa_decode.metal, qsdpa_prefill.metal); layout notes there.
//
// One threadgroup serves `rt` rows of one (batch, KV head) against the keys
// [n0, n1), with one SIMD group per row. Keys go in tiles of 32:
//   1. (mask arrays) lane j reads the mask of key t0+j for its row; a tile
//      that no row of the threadgroup can see is skipped before any K/V read;
//   2. the whole threadgroup copies the tile's packed K rows (16-byte loads
//      when aligned) and their scales/biases (as f32) into threadgroup
//      memory: every K byte is read from device memory once, for all rows;
//   3. each SIMD group scores the 32 keys for its row. Lane `lane` owns the
//      head-dim elements e = 32*i + lane (chunk i), so the 32 elements of a
//      chunk share one quantization group and its scale is a broadcast:
//        s_j = sum_g scale_jg * sum_{e in g} q_e code_je + sum_g bias_jg * qsum_g
//      (q pre-scaled in f32, qsum_g = sum of q over group g, held by lane g);
//      a simd_sum per key, lane j keeps s_j;
//   4. online softmax in f32 (simd_max / simd_sum), lane j holds p_j;
//   5. V is staged like K, then o_e += p_j * scale_jg * code_je (lane's
//      elements) and lane g accumulates sum_j p_j * bias_jg for group g.
// Causal masks stop the loop at the last key any row of the threadgroup can
// see. Code extraction: 8-bit reads bytes, 4-bit nibbles, the other widths
// read a bit stream across word boundaries.
#pragma once

#include "mlxq_utils.h"

// Code of element e of a packed row staged in threadgroup memory. BITS 0:
// the width is `bits`, known only at run time (the kernels for mixed K/V
// widths without an instance of their own).
template <int BITS>
METAL_FUNC uint mlxq_code(const threadgroup uint* row, int e, int bits) {
  if (BITS == 8) {
    return ((const threadgroup uchar*)row)[e];
  } else if (BITS == 4) {
    const uint byte = ((const threadgroup uchar*)row)[e >> 1];
    return (e & 1) ? (byte >> 4) : (byte & 0xfu);
  } else {
    const int nb = BITS ? BITS : bits;
    const int bit = e * nb;
    const int w = bit >> 5;
    const int off = bit & 31;
    uint v = row[w] >> off;
    if (off + nb > 32) {
      v |= row[w + 1] << (32 - off);
    }
    return v & ((1u << nb) - 1u);
  }
}

// The widest code a kernel stages (its threadgroup rows' size): run-time
// widths (0) may be 8 bits.
#define MQ_STAGE_BITS(KB, VB) \
  (((KB) == 0 || (VB) == 0) ? 8 : ((KB) > (VB) ? (KB) : (VB)))

// log2 of the 32-element chunks per quantization group (32, 64 or 128).
METAL_FUNC int mlxq_group_shift(int group_size) {
  return group_size == 32 ? 0 : (group_size == 64 ? 1 : 2);
}

// Copies the packed rows, scales and biases of keys [t0, t0 + nk) into
// threadgroup memory (rows of W words and G floats). Every thread of the
// threadgroup takes part.
METAL_FUNC void mlxq_stage(
    const device uint* w,
    mlxq_i64 w_ns,
    const device uchar* sc,
    mlxq_i64 s_base,
    mlxq_i64 s_ns,
    const device uchar* bi,
    mlxq_i64 b_base,
    mlxq_i64 b_ns,
    int dt,
    int t0,
    int nk,
    int W,
    int G,
    int vec4,
    threadgroup uint* codes,
    threadgroup float* tscale,
    threadgroup float* tbias,
    int tid,
    int nthreads) {
  if (vec4) {
    const int W4 = W >> 2;
    for (int idx = tid; idx < nk * W4; idx += nthreads) {
      const int j = idx / W4;
      const int c = idx - j * W4;
      const uint4 v = ((const device uint4*)(w + (t0 + j) * w_ns))[c];
      threadgroup uint* d = codes + j * W + 4 * c;
      d[0] = v.x;
      d[1] = v.y;
      d[2] = v.z;
      d[3] = v.w;
    }
  } else {
    for (int idx = tid; idx < nk * W; idx += nthreads) {
      const int j = idx / W;
      const int c = idx - j * W;
      codes[idx] = w[(t0 + j) * w_ns + c];
    }
  }
  for (int idx = tid; idx < nk * G; idx += nthreads) {
    const int j = idx / G;
    const int g = idx - j * G;
    tscale[idx] = mlxq_load(sc, s_base + (t0 + j) * s_ns + g, dt);
    tbias[idx] = mlxq_load(bi, b_base + (t0 + j) * b_ns + g, dt);
  }
}

// Rows [r0, r0 + rt) of (b, kvh) against keys [n0, n1): see the top of this
// file. `direct` writes the normalised output; otherwise the unnormalised
// output and (max, sum) go to partial slot `blk` of each row. KBITS and
// VBITS are the K and V code widths (0: p.k_bits / p.v_bits at run time);
// each has its own group size.
template <typename T, int KBITS, int VBITS, int DMAX>
METAL_FUNC void mlxq_attend(
    const device T* q,
    const device uint* kw,
    const device uchar* ks,
    const device uchar* kb,
    const device uint* vw,
    const device uchar* vs,
    const device uchar* vb,
    const device uchar* mask,
    const device float* sinks,
    device T* out,
    device float* part_o,
    device float* part_ml,
    constant MlxqSdpaParams& p,
    int b,
    int kvh,
    int r0,
    int rt,
    int n0,
    int n1,
    int blk,
    bool direct,
    threadgroup uint* tg_codes,
    threadgroup float* tg_scale,
    threadgroup float* tg_bias,
    threadgroup int* tg_live,
    int tid,
    int nthreads,
    int sg,
    int lane) {
  constexpr int DL = DMAX / 32; // head-dim chunks per lane, at most
  const int rep = p.rep;
  const bool active = sg < rt; // SIMD-uniform
  const int r = r0 + sg;
  const int l = mlxq_row_position(active ? r : 0, rep);
  const int h = mlxq_row_head(kvh, active ? r : 0, rep);
  const int dkc = p.Dk >> 5;
  const int dvc = p.Dv >> 5;
  // Chunks per group (1, 2 or 4) as a shift, groups and words per row.
  const int kshift = mlxq_group_shift(p.k_group_size);
  const int vshift = mlxq_group_shift(p.v_group_size);
  const int kcpg = 1 << kshift;
  const int Gk = p.Dk / p.k_group_size;
  const int Gv = p.Dv / p.v_group_size;
  const int kbits = KBITS ? KBITS : p.k_bits;
  const int vbits = VBITS ? VBITS : p.v_bits;
  const int Wk = p.Dk * kbits / 32;
  const int Wv = p.Dv * vbits / 32;
#if defined(MQ_BUG_LANE_INDEX)
  const int elane = lane ^ 1; // planted bug (emulator tests): wrong element
#else
  const int elane = lane;
#endif

  // Queries, pre-scaled in f32: chunk i of this lane is element 32*i + lane.
  float qv[DL];
  {
    const device T* qrow = q + b * p.q_strides[0] + h * p.q_strides[1] +
        l * p.q_strides[2];
    for (int i = 0; i < DL; ++i) {
      qv[i] = (active && i < dkc)
          ? mlxq_to_float(qrow[(32 * i + lane) * p.q_strides[3]]) * p.scale
          : 0.0f;
    }
  }
  // Group sums of the queries; lane g keeps group g's.
  float qsum = 0.0f;
  for (int g = 0; g < DL; ++g) {
    if (g < Gk) {
      float part = 0.0f;
      for (int i = 0; i < DL; ++i) {
        if (i < dkc && (i >> kshift) == g) {
          part += qv[i];
        }
      }
      const float s = simd_sum(part);
      if (lane == g) {
        qsum = s;
      }
    }
  }

  const mlxq_i64 kw_base = b * p.kw_strides[0] + kvh * p.kw_strides[1];
  const mlxq_i64 ks_base = b * p.ks_strides[0] + kvh * p.ks_strides[1];
  const mlxq_i64 kb_base = b * p.kb_strides[0] + kvh * p.kb_strides[1];
  const mlxq_i64 vw_base = b * p.vw_strides[0] + kvh * p.vw_strides[1];
  const mlxq_i64 vs_base = b * p.vs_strides[0] + kvh * p.vs_strides[1];
  const mlxq_i64 vb_base = b * p.vb_strides[0] + kvh * p.vb_strides[1];
  const int shift = p.N - p.L; // causal: query l sees keys n <= l + shift
  int n_end = n1;
  if (p.mask_kind == MQ_MASK_CAUSAL) {
    // Keys past the last row's limit are hidden from every row here.
    const int last_l = mlxq_row_position(r0 + rt - 1, rep);
    n_end = min(n1, max(last_l + shift + 1, n0));
  }

  float m = -INFINITY;
  float lsum = 0.0f;
  float o[DL];
  for (int i = 0; i < DL; ++i) {
    o[i] = 0.0f;
  }
  float ob = 0.0f; // lane g: sum_j p_j * bias_jg of value group g

  for (int t0 = n0; t0 < n_end; t0 += MQ_TILE_KEYS) {
    const int nk = min(MQ_TILE_KEYS, n_end - t0);
    const int n = t0 + lane; // this lane's key in the tile

    // 1. Mask of this lane's key; skip tiles that no row can see.
    bool mvis = true;
    float madd = 0.0f;
    if (p.mask_kind == MQ_MASK_ARRAY) {
      mvis = false;
      if (active && lane < nk) {
        const mlxq_i64 idx = b * p.m_strides[0] + h * p.m_strides[1] +
            l * p.m_strides[2] + n * p.m_strides[3];
        if (p.mask_dtype == MQ_DT_BOOL) {
          mvis = ((const device bool*)mask)[idx];
        } else {
          madd = mlxq_load(mask, idx, p.mask_dtype);
          mvis = madd != -INFINITY;
        }
      }
      const bool row_sees_tile = simd_any(mvis);
      if (lane == 0) {
        tg_live[sg] = row_sees_tile ? 1 : 0;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      int live = 0;
      for (int s = 0; s < p.row_tile; ++s) {
        live |= tg_live[s];
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (!live) {
        continue; // threadgroup-uniform
      }
    }

    // 2. Stage the tile's keys.
    mlxq_stage(
        kw + kw_base, p.kw_strides[2], ks, ks_base, p.ks_strides[2], kb,
        kb_base, p.kb_strides[2], p.scale_dtype, t0, nk, Wk, Gk, p.k_vec4,
        tg_codes, tg_scale, tg_bias, tid, nthreads);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. Scores: lane j ends up with s_j.
    float mys = -INFINITY;
    if (active) {
      for (int j = 0; j < nk; ++j) {
        const threadgroup uint* row = tg_codes + j * Wk;
        const threadgroup float* sc = tg_scale + j * Gk;
        float acc = 0.0f;
        float t = 0.0f;
        for (int i = 0; i < DL; ++i) {
          if (i < dkc) {
            t = fma(qv[i], float(mlxq_code<KBITS>(row, 32 * i + elane, kbits)), t);
            if (((i + 1) & (kcpg - 1)) == 0) {
              acc = fma(t, sc[i >> kshift], acc);
              t = 0.0f;
            }
          }
        }
        if (lane < Gk) {
          acc = fma(tg_bias[j * Gk + lane], qsum, acc);
        }
        const float s = simd_sum(acc);
        if (lane == j) {
          mys = s;
        }
      }
      // 4. Mask, then the online softmax update.
      if (p.mask_kind == MQ_MASK_CAUSAL && n > l + shift) {
        mys = -INFINITY;
      } else if (p.mask_kind == MQ_MASK_ARRAY) {
        mys = mvis ? mys + madd : -INFINITY; // (madd is 0 for bool masks)
      }
    }
    float pj_lane = 0.0f;
    if (active) {
      const float m_new = max(m, simd_max(mys));
      if (m_new != -INFINITY) {
        pj_lane = exp(mys - m_new);
        const float corr = exp(m - m_new);
        lsum = lsum * corr + simd_sum(pj_lane);
        for (int i = 0; i < DL; ++i) {
          o[i] *= corr;
        }
        ob *= corr;
        m = m_new;
      }
    }

    // 5. Stage the tile's values, then accumulate them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mlxq_stage(
        vw + vw_base, p.vw_strides[2], vs, vs_base, p.vs_strides[2], vb,
        vb_base, p.vb_strides[2], p.scale_dtype, t0, nk, Wv, Gv, p.v_vec4,
        tg_codes, tg_scale, tg_bias, tid, nthreads);
#if !defined(MQ_BUG_DROP_BARRIER)
    threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
    if (active) {
      for (int j = 0; j < nk; ++j) {
        const float pj = simd_shuffle(pj_lane, ushort(j));
        if (pj != 0.0f) { // SIMD-uniform: masked keys cost no unpacking
          const threadgroup uint* row = tg_codes + j * Wv;
          const threadgroup float* sc = tg_scale + j * Gv;
          for (int i = 0; i < DL; ++i) {
            if (i < dvc) {
              o[i] = fma(
                  pj * sc[i >> vshift],
                  float(mlxq_code<VBITS>(row, 32 * i + elane, vbits)),
                  o[i]);
            }
          }
          if (lane < Gv) {
            ob = fma(pj, tg_bias[j * Gv + lane], ob);
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (!active) {
    return;
  }
  // Unnormalised output of this lane's elements, bias terms included.
  for (int i = 0; i < DL; ++i) {
    o[i] += simd_shuffle(ob, ushort(i >> vshift));
  }
  if (direct) {
    const float sink = p.has_sinks ? sinks[h * p.sinks_stride] : 0.0f;
    const float inv = mlxq_inverse_denominator(m, lsum, p.has_sinks != 0, sink);
    device T* orow = out + ((mlxq_i64(b) * p.Hq + h) * p.L + l) * p.Dv;
    for (int i = 0; i < DL; ++i) {
      if (i < dvc) {
        orow[32 * i + lane] = mlxq_from_float<T>(o[i] * inv);
      }
    }
  } else {
    const mlxq_i64 slot =
        ((mlxq_i64(b) * p.Hkv + kvh) * p.rows + r) * p.n_blocks + blk;
    for (int i = 0; i < DL; ++i) {
      if (i < dvc) {
        part_o[slot * p.Dv + 32 * i + lane] = o[i];
      }
    }
    if (lane == 0) {
      part_ml[2 * slot] = m;
      part_ml[2 * slot + 1] = lsum;
    }
  }
}
