// QuantizedSDPA decode: split-K attention over affine-quantized K/V, and the
// log-sum-exp merge of the key blocks.
//
// Layout
//   q     [B, Hq, L, Dk] float/half/bfloat16, any strides
//   K, V  mx.quantize triples of [B, Hkv, N, Dk] / [B, Hkv, N, Dv]: packed
//         uint32 rows (little-endian bit stream, element e at bits
//         [e*bits, (e+1)*bits)), scales and biases per group of group_size;
//         batch/head/sequence strides are arguments (cache views are read in
//         place), the last axis is contiguous
//   mask  [B, Hq, L, N] bool or additive float (broadcast: zero strides)
//   out   [B, Hq, L, Dv] row-contiguous, q's dtype
//   rows  r = l * rep + (h - kvh * rep): the rep query heads of a KV head
//         and the L query positions; a row tile is <= 16 consecutive rows
//
// Grid (threadgroups): x = key block, y = row tile + row_tiles * kvh, z = b.
// Threadgroup: one SIMD group (32 lanes) per row of the tile. Each key tile
// (32 keys) is copied once into threadgroup memory and shared by every query
// head of the KV head (qsdpa.h), so K/V bytes are read once per block, never
// once per query head. The number of blocks is chosen by the host
// (csrc/metal/dispatch.cpp) so that B * Hkv * blocks threadgroups fill the
// GPU at short and long context alike.
//
// Each block writes, per row, its unnormalised output (f32, [Dv]) and its
// running (max, sum) to the partial buffers:
//   part_o  [B, Hkv, rows, n_blocks, Dv]   part_ml [B, Hkv, rows, n_blocks, 2]
// mlxq_qsdpa_merge then combines the blocks of each row by log-sum-exp,
// adds the sink logit and writes the output (and, with p.with_lse, each
// row's log-sum-exp, lse [B, Hq, L] float). With a single block the decode
// kernel normalises and writes the output itself (p.direct), unless the
// log-sum-exp is asked for.
//
// Threadgroup memory: 32 packed rows (K, then V in the same buffer) plus
// their scales and biases as f32: at most 20 KB (Dk or Dv 512, 8 bits).
// Fully masked rows output 0 (no NaN), like the CPU kernel.
#include "qsdpa.h"

template <typename T, int KBITS, int VBITS, int DMAX>
[[kernel]] void mlxq_qsdpa_decode(
    const device T* q [[buffer(0)]],
    const device uint* kw [[buffer(1)]],
    const device uchar* ks [[buffer(2)]],
    const device uchar* kb [[buffer(3)]],
    const device uint* vw [[buffer(4)]],
    const device uchar* vs [[buffer(5)]],
    const device uchar* vb [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    const device float* sinks [[buffer(8)]],
    device T* out [[buffer(9)]],
    device float* part_o [[buffer(10)]],
    device float* part_ml [[buffer(11)]],
    constant MlxqSdpaParams& p [[buffer(12)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint3 tpg [[threads_per_threadgroup]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint tg_codes[MQ_TILE_KEYS * DMAX * MQ_STAGE_BITS(KBITS, VBITS) / 32];
  threadgroup float tg_scale[MQ_TILE_KEYS * DMAX / 32];
  threadgroup float tg_bias[MQ_TILE_KEYS * DMAX / 32];
  threadgroup int tg_live[MQ_MAX_ROW_TILE];

  const int blk = tgid.x;
  const int tile = tgid.y % p.row_tiles;
  const int kvh = tgid.y / p.row_tiles;
  const int b = tgid.z;
  const int r0 = tile * p.row_tile;
  const int rt = min(p.row_tile, p.rows - r0);
  const int n0 = blk * p.block_keys;
  const int n1 = min(p.N, n0 + p.block_keys);
  mlxq_attend<T, KBITS, VBITS, DMAX>(
      q, kw, ks, kb, vw, vs, vb, mask, sinks, out, part_o, part_ml, p, b, kvh,
      r0, rt, n0, n1, blk, p.direct != 0, tg_codes, tg_scale, tg_bias, tg_live,
      tid, tpg.x, sg, lane);
}

// One SIMD group per row; lanes own the output elements 32*i + lane.
// Grid: ceil(B * Hkv * rows / simdgroups per threadgroup) threadgroups.
template <typename T>
[[kernel]] void mlxq_qsdpa_merge(
    const device float* part_o [[buffer(0)]],
    const device float* part_ml [[buffer(1)]],
    const device float* sinks [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant MlxqSdpaParams& p [[buffer(4)]],
    device float* lse [[buffer(5)]],
    uint tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int DL = 16; // Dv <= 512
  const int row = tgid * nsg + sg;
  if (row >= p.B * p.Hkv * p.rows) {
    return; // a whole SIMD group
  }
  const int r = row % p.rows;
  const int bk = row / p.rows;
  const int kvh = bk % p.Hkv;
  const int b = bk / p.Hkv;
  const int l = mlxq_row_position(r, p.rep);
  const int h = mlxq_row_head(kvh, r, p.rep);
  const int nb = p.n_blocks;
  const int dvc = p.Dv >> 5;
  const mlxq_i64 slot0 = mlxq_i64(row) * nb;

  float m = -INFINITY;
  for (int s = lane; s < nb; s += 32) {
    m = max(m, part_ml[2 * (slot0 + s)]);
  }
  m = simd_max(m);
  float lsum = 0.0f;
  float o[DL];
  for (int i = 0; i < DL; ++i) {
    o[i] = 0.0f;
  }
  if (m != -INFINITY) {
    float ls = 0.0f;
    for (int s = lane; s < nb; s += 32) {
      const float ms = part_ml[2 * (slot0 + s)];
      if (ms != -INFINITY) {
        ls += exp(ms - m) * part_ml[2 * (slot0 + s) + 1];
      }
    }
    lsum = simd_sum(ls);
    for (int s = 0; s < nb; ++s) {
      const float ms = part_ml[2 * (slot0 + s)];
      if (ms == -INFINITY) {
        continue; // the block saw no key of this row
      }
      const float w = exp(ms - m);
      const device float* po = part_o + (slot0 + s) * p.Dv;
      for (int i = 0; i < DL; ++i) {
        if (i < dvc) {
          o[i] = fma(w, po[32 * i + lane], o[i]);
        }
      }
    }
  }
  const float sink = p.has_sinks ? sinks[h * p.sinks_stride] : 0.0f;
  const float inv = mlxq_inverse_denominator(m, lsum, p.has_sinks != 0, sink);
  if (p.with_lse && lane == 0) {
    lse[(mlxq_i64(b) * p.Hq + h) * p.L + l] =
        mlxq_log_denominator(m, lsum, p.has_sinks != 0, sink);
  }
  device T* orow = out + ((mlxq_i64(b) * p.Hq + h) * p.L + l) * p.Dv;
  for (int i = 0; i < DL; ++i) {
    if (i < dvc) {
      orow[32 * i + lane] = mlxq_from_float<T>(o[i] * inv);
    }
  }
}

// Kernel names: _b<bits> for equal K/V widths, _k8v4 for 8-bit keys with
// 4-bit values, _kv for every other pair (widths read at run time).
#define MQ_INST_DECODE(tname, T, kv, kb, vb, dmax)                      \
  MQ_INSTANTIATE(                                                     \
      "mlxq_qsdpa_decode_" #tname "_" #kv "_d" #dmax, mlxq_qsdpa_decode, T, \
      kb, vb, dmax)
#define MQ_INST_DECODE_BITS(tname, T, kv, kb, vb) \
  MQ_INST_DECODE(tname, T, kv, kb, vb, 128)       \
  MQ_INST_DECODE(tname, T, kv, kb, vb, 512)
#define MQ_INST_DECODE_TYPE(tname, T)              \
  MQ_INST_DECODE_BITS(tname, T, b2, 2, 2)          \
  MQ_INST_DECODE_BITS(tname, T, b3, 3, 3)          \
  MQ_INST_DECODE_BITS(tname, T, b4, 4, 4)          \
  MQ_INST_DECODE_BITS(tname, T, b5, 5, 5)          \
  MQ_INST_DECODE_BITS(tname, T, b6, 6, 6)          \
  MQ_INST_DECODE_BITS(tname, T, b8, 8, 8)          \
  MQ_INST_DECODE_BITS(tname, T, k8v4, 8, 4)        \
  MQ_INST_DECODE_BITS(tname, T, kv, 0, 0) \
  MQ_INSTANTIATE("mlxq_qsdpa_merge_" #tname, mlxq_qsdpa_merge, T)

MQ_INST_DECODE_TYPE(f32, float)
#if !defined(MQ_ONLY_F32) // (a smaller build for the planted-bug tests)
MQ_INST_DECODE_TYPE(f16, half)
MQ_INST_DECODE_TYPE(bf16, mlxq_bfloat16)
#endif
