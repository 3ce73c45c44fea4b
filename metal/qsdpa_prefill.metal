// QuantizedSDPA prefill (large L): tiled FlashAttention over affine-quantized
// K/V that never materialises the [L, N] score matrix.
//
// Layout (as in qsdpa_decode.metal)
//   q [B, Hq, L, Dk] any strides; K/V mx.quantize triples [B, Hkv, N, *] with
//   strided batch/head/sequence axes; mask [B, Hq, L, N] bool/additive with
//   strides; out [B, Hq, L, Dv] row-contiguous in q's dtype.
//   Rows r = l * rep + (h - kvh * rep): a row tile of <= 16 consecutive rows
//   covers every query head of the KV head for 16 / rep query positions.
//
// Grid (threadgroups): x = row tile, y = kvh, z = b. Threadgroup: one SIMD
// group per row. Each threadgroup walks all N keys in tiles of 32 with an
// online softmax (qsdpa.h): the tile's packed K rows are staged once in
// threadgroup memory for all rows of the threadgroup, scored, then V is
// staged into the same buffer and accumulated. Nothing is written but the
// normalised output: no partials, no merge.
//
// Skipping: with mask="causal" the loop stops at the last key that the
// tile's last query can see (bottom-right aligned), so the upper triangle is
// never read; with a mask array, a tile that every row of the threadgroup
// masks (bool False / additive -inf) is skipped before its K/V are loaded.
// Rows that see no key output 0.
#include "qsdpa.h"

template <typename T, int KBITS, int VBITS, int DMAX>
[[kernel]] void mlxq_qsdpa_prefill(
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

  const int tile = tgid.x;
  const int kvh = tgid.y;
  const int b = tgid.z;
  const int r0 = tile * p.row_tile;
  const int rt = min(p.row_tile, p.rows - r0);
  mlxq_attend<T, KBITS, VBITS, DMAX>(
      q, kw, ks, kb, vw, vs, vb, mask, sinks, out, nullptr, nullptr, p, b,
      kvh, r0, rt, 0, p.N, 0, true, tg_codes, tg_scale, tg_bias, tg_live, tid,
      tpg.x, sg, lane);
}

// Kernel names: _b<bits> for equal K/V widths, _k8v4 for 8-bit keys with
// 4-bit values, _kv for every other pair (widths read at run time).
#define MQ_INST_PREFILL(tname, T, kv, kb, vb, dmax)                      \
  MQ_INSTANTIATE(                                                     \
      "mlxq_qsdpa_prefill_" #tname "_" #kv "_d" #dmax, mlxq_qsdpa_prefill, T, \
      kb, vb, dmax)
#define MQ_INST_PREFILL_BITS(tname, T, kv, kb, vb) \
  MQ_INST_PREFILL(tname, T, kv, kb, vb, 128)       \
  MQ_INST_PREFILL(tname, T, kv, kb, vb, 512)
#define MQ_INST_PREFILL_TYPE(tname, T)              \
  MQ_INST_PREFILL_BITS(tname, T, b2, 2, 2)          \
  MQ_INST_PREFILL_BITS(tname, T, b3, 3, 3)          \
  MQ_INST_PREFILL_BITS(tname, T, b4, 4, 4)          \
  MQ_INST_PREFILL_BITS(tname, T, b5, 5, 5)          \
  MQ_INST_PREFILL_BITS(tname, T, b6, 6, 6)          \
  MQ_INST_PREFILL_BITS(tname, T, b8, 8, 8)          \
  MQ_INST_PREFILL_BITS(tname, T, k8v4, 8, 4)        \
  MQ_INST_PREFILL_BITS(tname, T, kv, 0, 0)

MQ_INST_PREFILL_TYPE(f32, float)
#if !defined(MQ_ONLY_F32) // (a smaller build for the planted-bug tests)
MQ_INST_PREFILL_TYPE(f16, half)
MQ_INST_PREFILL_TYPE(bf16, mlxq_bfloat16)
#endif
