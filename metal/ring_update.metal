// RingUpdate, QuantizedRingUpdate and the strided copy they fall back on.
//
// Layout
//   out     row-contiguous [B, H, S, D] ring buffer (the primitive's output:
//           the donated input buffer itself, updated in place, or a fresh
//           copy made by mlxq_copy4d)
//   update  [B, H, T, D] read through its four strides, T <= S
//   pos     int32 on the device (a compiled decode step need not retrace);
//           update row t lands on ring row (pos + t) mod S, so a write may
//           straddle the end of the ring
//   packed/scales/biases (quantized) row-contiguous [B, H, S, W] uint32 and
//           [B, H, S, G] in the update's dtype, W = D * bits / 32,
//           G = D / group_size
//
// mlxq_ring_update and mlxq_copy4d move raw elements (1, 2, 4 or 8 bytes):
// one thread per element, grid (D, T or S, B*H) threads.
//
// mlxq_quantized_ring_update: one threadgroup of 32 threads (a SIMD group)
// per quantization group, grid (G, T, B*H) threadgroups. Each lane holds
// group_size / 32 values (element 32*k + lane of the group); simd_min /
// simd_max give the group's range, then scale and bias follow MLX's Metal
// affine quantize exactly, so the cache row is bit-identical to
// mx.quantize on the GPU:
//   w_min starts at +inf, w_max at 0 (so an all-negative group has max 0);
//   scale = max((w_max - w_min) / n_bins, 1e-7), negated unless
//   |w_min| > |w_max|; edge = the larger-magnitude end, q0 = round(edge /
//   scale) (round half away from zero); unless q0 == 0: scale = edge / q0,
//   bias = edge (else bias 0); code = min(round((w - bias) / scale), n_bins).
// Codes go through threadgroup memory; lane k then assembles packed word k of
// the group from the codes whose bits overlap it.
//
// A QuantizedRingUpdate dispatch writes one part of the triple (p.part:
// MQ_PART_CODES, _SCALES or _BIASES), since each such primitive owns one
// array; the host binds that array to the part's slot (and to the two other
// slots, which the kernel never touches). A QuantizedKVUpdate dispatch
// (MQ_PART_ALL) writes all three arrays of K or of V. The group's scale and
// bias are computed for every part; codes only for the codes and all parts.
#include "mlxq_utils.h"

template <typename E>
[[kernel]] void mlxq_copy4d(
    const device E* src [[buffer(0)]],
    device E* dst [[buffer(1)]],
    constant MlxqCopyParams& p [[buffer(2)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int d = gid.x;
  const int s = gid.y;
  const int bh = gid.z;
  if (d >= p.shape[3] || s >= p.shape[2] || bh >= p.shape[0] * p.shape[1]) {
    return;
  }
  const int b = bh / p.shape[1];
  const int h = bh - b * p.shape[1];
#if defined(MQ_BUG_OOB_WRITE)
  // Planted bug (emulator tests): the last element lands one past the end.
  const int d_out = (d == p.shape[3] - 1 && s == p.shape[2] - 1) ? d + 1 : d;
#else
  const int d_out = d;
#endif
  dst[(mlxq_i64(bh) * p.shape[2] + s) * p.shape[3] + d_out] =
      src[b * p.src_strides[0] + h * p.src_strides[1] + s * p.src_strides[2] +
          d * p.src_strides[3]];
}

// First ring row written: pos mod S (a negative position wraps too).
METAL_FUNC int mlxq_ring_start(const device int* pos, int S) {
  const int start = pos[0] % S;
  return start < 0 ? start + S : start;
}

template <typename E>
[[kernel]] void mlxq_ring_update(
    const device E* update [[buffer(0)]],
    const device int* pos [[buffer(1)]],
    device E* out [[buffer(2)]],
    constant MlxqRingParams& p [[buffer(3)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int d = gid.x;
  const int t = gid.y;
  const int bh = gid.z;
  if (d >= p.D || t >= p.T || bh >= p.B * p.H) {
    return;
  }
  const int b = bh / p.H;
  const int h = bh - b * p.H;
  const int row = (mlxq_ring_start(pos, p.S) + t) % p.S;
  out[(mlxq_i64(bh) * p.S + row) * p.D + d] =
      update[b * p.upd_strides[0] + h * p.upd_strides[1] +
             t * p.upd_strides[2] + d * p.upd_strides[3]];
}

template <typename T, int BITS>
[[kernel]] void mlxq_quantized_ring_update(
    const device T* update [[buffer(0)]],
    const device int* pos [[buffer(1)]],
    device uint* packed [[buffer(2)]],
    device T* scales [[buffer(3)]],
    device T* biases [[buffer(4)]],
    constant MlxqRingParams& p [[buffer(5)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uchar codes[128];

  const int g = tgid.x;
  const int t = tgid.y;
  const int bh = tgid.z;
  const int b = bh / p.H;
  const int h = bh - b * p.H;
  const int gs = p.group_size;
  const int vpl = gs / 32; // values per lane: 1, 2 or 4
  const device T* src = update + b * p.upd_strides[0] +
      h * p.upd_strides[1] + t * p.upd_strides[2];

  float w[4];
  float w_min = INFINITY; // MLX: Limits<T>::max, +inf for float types
  float w_max = 0.0f;     // MLX starts the max at 0, not -inf
  for (int k = 0; k < 4; ++k) {
    if (k < vpl) {
      const int e = g * gs + 32 * k + lane;
      w[k] = mlxq_to_float(src[e * p.upd_strides[3]]);
      w_min = min(w_min, w[k]);
      w_max = max(w_max, w[k]);
    }
  }
  w_min = simd_min(w_min);
  w_max = simd_max(w_max);

  const float n_bins = float((1 << BITS) - 1);
  const float eps = 1e-7f;
  float scale = max((w_max - w_min) / n_bins, eps);
  const bool side = abs(w_min) > abs(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = round(edge / scale);
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.0f : edge;

  const mlxq_i64 row =
      mlxq_i64(bh) * p.S + (mlxq_ring_start(pos, p.S) + t) % p.S;
  const bool all = p.part == MQ_PART_ALL;
  if (lane == 0 && (all || p.part == MQ_PART_SCALES)) {
    scales[row * p.G + g] = mlxq_from_float<T>(scale);
  }
  if (lane == 0 && (all || p.part == MQ_PART_BIASES)) {
    biases[row * p.G + g] = mlxq_from_float<T>(bias);
  }
  if (!all && p.part != MQ_PART_CODES) { // uniform across the threadgroup
    return;
  }

  for (int k = 0; k < 4; ++k) {
    if (k < vpl) {
#if defined(MQ_BUG_RINT)
      // Planted bug (emulator tests): ties to even instead of away from zero.
      codes[32 * k + lane] = uchar(min(rint((w[k] - bias) / scale), n_bins));
#else
      codes[32 * k + lane] = uchar(min(round((w[k] - bias) / scale), n_bins));
#endif
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int wpg = gs * BITS / 32; // packed words of one group (<= 32)
  if (int(lane) < wpg) {
    const int lo = 32 * lane; // this word holds bits [lo, lo + 32) of the group
    uint word = 0;
    for (int e = lo / BITS; e * BITS < lo + 32; ++e) {
      const int bit = e * BITS;
      const uint c = codes[e];
      word |= bit >= lo ? (c << (bit - lo)) : (c >> (lo - bit));
    }
    packed[row * p.W + g * wpg + lane] = word;
  }
}

MQ_INSTANTIATE("mlxq_copy4d_u8", mlxq_copy4d, uchar)
MQ_INSTANTIATE("mlxq_copy4d_u16", mlxq_copy4d, ushort)
MQ_INSTANTIATE("mlxq_copy4d_u32", mlxq_copy4d, uint)
MQ_INSTANTIATE("mlxq_copy4d_u64", mlxq_copy4d, ulong)
MQ_INSTANTIATE("mlxq_ring_update_u8", mlxq_ring_update, uchar)
MQ_INSTANTIATE("mlxq_ring_update_u16", mlxq_ring_update, ushort)
MQ_INSTANTIATE("mlxq_ring_update_u32", mlxq_ring_update, uint)
MQ_INSTANTIATE("mlxq_ring_update_u64", mlxq_ring_update, ulong)

#define MQ_INST_QRING(tname, T, bits)                                  \
  MQ_INSTANTIATE(                                                      \
      "mlxq_quantized_ring_update_" #tname "_b" #bits,                   \
      mlxq_quantized_ring_update, T, bits)
#define MQ_INST_QRING_TYPE(tname, T) \
  MQ_INST_QRING(tname, T, 2)         \
  MQ_INST_QRING(tname, T, 3)         \
  MQ_INST_QRING(tname, T, 4)         \
  MQ_INST_QRING(tname, T, 5)         \
  MQ_INST_QRING(tname, T, 6)         \
  MQ_INST_QRING(tname, T, 8)

MQ_INST_QRING_TYPE(f32, float)
MQ_INST_QRING_TYPE(f16, half)
MQ_INST_QRING_TYPE(bf16, mlxq_bfloat16)
