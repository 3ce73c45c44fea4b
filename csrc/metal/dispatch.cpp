#include "metal/dispatch.h"

#include <algorithm>
#include <stdexcept>

#include "quantization.h"
#include "sdpa_dims.h"

namespace mlxq::metal_dispatch {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// 16-byte loads of packed K/V rows need rows of whole uint4s at 16-byte
// aligned addresses: an aligned buffer base, and offset and strides in
// whole uint4s.
bool vec4_ok(int words, const int64_t strides[3], int64_t offset, bool base_aligned16) {
  return base_aligned16 && words % 4 == 0 && strides[0] % 4 == 0 && strides[1] % 4 == 0 &&
      strides[2] % 4 == 0 && offset % 4 == 0;
}

// Threads per threadgroup of an element-wise dispatch over (x, y).
Size3 elementwise_group(int64_t x, int64_t y) {
  Size3 g;
  g.x = std::max<int64_t>(1, std::min<int64_t>(x, 256));
  g.y = std::max<int64_t>(1, std::min<int64_t>(y, 256 / g.x));
  return g;
}

} // namespace

const char* dtype_tag(int dtype) {
  switch (dtype) {
    case MQ_DT_F16:
      return "f16";
    case MQ_DT_BF16:
      return "bf16";
    default:
      return "f32";
  }
}

std::string sdpa_widths_tag(int k_bits, int v_bits) {
  if (k_bits == v_bits) {
    return "b" + std::to_string(k_bits);
  }
  return k_bits == 8 && v_bits == 4 ? "k8v4" : "kv";
}

SdpaPlan plan_sdpa(const SdpaProblem& pr) {
  if (pr.Hkv < 1 || pr.Hq % pr.Hkv != 0 || pr.Dk % 32 != 0 || pr.Dv % 32 != 0 || pr.Dk > 512 ||
      pr.Dv > 512 || pr.k_group_size < 32 || pr.v_group_size < 32) {
    throw std::invalid_argument("[mlxq.metal] unsupported QuantizedSDPA shape");
  }
  SdpaPlan plan;
  MlxqSdpaParams& p = plan.params;
  copy_dims(pr, p);
  p.rep = pr.Hq / pr.Hkv;
  p.mask_kind = pr.mask_kind;
  p.mask_dtype = pr.mask_dtype;
  p.has_sinks = pr.has_sinks ? 1 : 0;
  for (int d = 0; d < 4; ++d) {
    p.q_strides[d] = pr.q_strides[d];
    p.m_strides[d] = pr.m_strides[d];
  }
  for (int d = 0; d < 3; ++d) {
    p.kw_strides[d] = pr.k_strides[0][d];
    p.ks_strides[d] = pr.k_strides[1][d];
    p.kb_strides[d] = pr.k_strides[2][d];
    p.vw_strides[d] = pr.v_strides[0][d];
    p.vs_strides[d] = pr.v_strides[1][d];
    p.vb_strides[d] = pr.v_strides[2][d];
  }
  p.sinks_stride = pr.sinks_stride;
  p.k_vec4 =
      vec4_ok(pr.Dk * pr.k_bits / 32, pr.k_strides[0], pr.k_packed_offset, pr.k_base_aligned16);
  p.v_vec4 =
      vec4_ok(pr.Dv * pr.v_bits / 32, pr.v_strides[0], pr.v_packed_offset, pr.v_base_aligned16);

  // Row tiles: one SIMD group per row, at most MQ_MAX_ROW_TILE rows (and
  // no more threads than the pipeline allows).
  p.rows = p.rep * pr.L;
  const int max_rows = std::clamp(pr.max_threads / 32, 1, MQ_MAX_ROW_TILE);
  const int tiles = static_cast<int>(ceil_div(p.rows, max_rows));
  p.row_tile = std::max(1, static_cast<int>(ceil_div(p.rows, std::max(tiles, 1))));
  p.row_tiles = std::max(1, static_cast<int>(ceil_div(p.rows, p.row_tile)));
  const int64_t units = int64_t(pr.B) * pr.Hkv * p.row_tiles;
  const int target = std::max(1, pr.target_threadgroups);

  bool prefill = pr.mode == SdpaMode::Prefill && !pr.with_lse;
  if (pr.mode == SdpaMode::Auto && !pr.with_lse) {
    // Prefill walks all keys in one threadgroup per row tile: only worth it
    // when the row tiles alone give the GPU enough threadgroups.
    prefill = pr.L >= kPrefillMinL && units * 4 >= target;
  }
  plan.prefill = prefill;
  const int dmax = std::max(pr.Dk, pr.Dv) <= 128 ? 128 : 512;
  const std::string suffix = std::string(dtype_tag(pr.q_dtype)) + "_" +
      sdpa_widths_tag(pr.k_bits, pr.v_bits) + "_d" + std::to_string(dmax);
  plan.group = Size3{32 * int64_t(p.row_tile), 1, 1};

  if (prefill) {
    p.n_blocks = 1;
    p.block_keys = pr.N;
    p.direct = 1;
    plan.kernel = "mlxq_qsdpa_prefill_" + suffix;
    plan.grid = Size3{p.row_tiles, pr.Hkv, pr.B};
    return plan;
  }

  // Decode: split the keys into blocks until B * Hkv * row tiles * blocks
  // threadgroups reach the target, keeping at least min_block_keys keys
  // (rounded to whole 32-key tiles) per block.
  const int min_keys = std::max(1, pr.min_block_keys);
  int64_t blocks = ceil_div(target, units);
  blocks = std::min<int64_t>(blocks, std::max<int64_t>(1, pr.N / min_keys));
  blocks = std::clamp<int64_t>(blocks, 1, kMaxBlocks);
  // Whole tiles per block: rounded down (so the block count does not drop)
  // unless that would leave fewer than min_keys keys per block.
  int64_t block_keys = ceil_div(std::max(pr.N, 1), blocks);
  const int64_t down = block_keys / MQ_TILE_KEYS * MQ_TILE_KEYS;
  block_keys = down >= std::max(min_keys, MQ_TILE_KEYS)
      ? down
      : ceil_div(block_keys, MQ_TILE_KEYS) * MQ_TILE_KEYS;
  blocks = std::max<int64_t>(1, ceil_div(pr.N, block_keys));
  if (blocks > kMaxBlocks) {
    block_keys = ceil_div(ceil_div(pr.N, kMaxBlocks), MQ_TILE_KEYS) * MQ_TILE_KEYS;
    blocks = ceil_div(pr.N, block_keys);
  }
  p.n_blocks = static_cast<int>(blocks);
  p.block_keys = static_cast<int>(block_keys);
  p.with_lse = pr.with_lse ? 1 : 0;
  p.direct = blocks == 1 && !pr.with_lse ? 1 : 0;
  plan.kernel = "mlxq_qsdpa_decode_" + suffix;
  plan.grid = Size3{blocks, int64_t(p.row_tiles) * pr.Hkv, pr.B};
  if (!p.direct) {
    plan.merge = true;
    plan.merge_kernel = std::string("mlxq_qsdpa_merge_") + dtype_tag(pr.q_dtype);
    const int64_t rows_total = int64_t(pr.B) * pr.Hkv * p.rows;
    plan.merge_group = Size3{32 * kMergeSimdGroups, 1, 1};
    plan.merge_grid = Size3{ceil_div(rows_total, kMergeSimdGroups), 1, 1};
    plan.partial_o_floats = rows_total * blocks * pr.Dv;
    plan.partial_ml_floats = rows_total * blocks * 2;
  }
  return plan;
}

// The update's shape and strides, shared by both ring plans.
static void
set_ring_shape(MlxqRingParams& p, int B, int H, int S, int T, int D, const int64_t upd_strides[4]) {
  for (int d = 0; d < 4; ++d) {
    p.upd_strides[d] = upd_strides[d];
  }
  p.B = B;
  p.H = H;
  p.S = S;
  p.T = T;
  p.D = D;
}

RingPlan
plan_ring_update(int B, int H, int S, int T, int D, int itemsize, const int64_t upd_strides[4]) {
  RingPlan plan;
  plan.kernel = "mlxq_ring_update_u" + std::to_string(8 * itemsize);
  plan.grid = Size3{D, T, int64_t(B) * H};
  plan.group = elementwise_group(D, T);
  plan.grid_is_threads = true;
  set_ring_shape(plan.params, B, H, S, T, D, upd_strides);
  return plan;
}

RingPlan plan_quantized_ring_update(
    int B,
    int H,
    int S,
    int T,
    int D,
    int group_size,
    int bits,
    int dtype,
    int part,
    const int64_t upd_strides[4]) {
  RingPlan plan;
  plan.kernel =
      std::string("mlxq_quantized_ring_update_") + dtype_tag(dtype) + "_b" + std::to_string(bits);
  const int G = D / group_size;
  plan.grid = Size3{G, T, int64_t(B) * H};
  plan.group = Size3{32, 1, 1}; // one SIMD group per quantization group
  plan.grid_is_threads = false;
  MlxqRingParams& p = plan.params;
  set_ring_shape(p, B, H, S, T, D, upd_strides);
  p.group_size = group_size;
  p.bits = bits;
  p.W = D * bits / 32;
  p.G = G;
  p.part = part;
  return plan;
}

CopyPlan plan_copy4d(const int shape[4], const int64_t strides[4], int itemsize) {
  CopyPlan plan;
  plan.kernel = "mlxq_copy4d_u" + std::to_string(8 * itemsize);
  plan.grid = Size3{shape[3], shape[2], int64_t(shape[0]) * shape[1]};
  plan.group = elementwise_group(shape[3], shape[2]);
  plan.grid_is_threads = true;
  for (int d = 0; d < 4; ++d) {
    plan.params.shape[d] = shape[d];
    plan.params.src_strides[d] = strides[d];
  }
  return plan;
}

DequantPlan plan_dequantize_into(
    int B,
    int H,
    int N,
    int D,
    int group_size,
    int bits,
    int out_dtype,
    int scale_dtype,
    const int64_t w_strides[4],
    const int64_t s_strides[4],
    const int64_t b_strides[4]) {
  // 8 codes of a thread share one group: every supported group size is a
  // multiple of 8.
  if (!is_supported_bits(bits) || !is_supported_group_size(group_size) || D % group_size != 0) {
    throw std::invalid_argument("[mlxq.metal] unsupported DequantizeInto shape");
  }
  DequantPlan plan;
  plan.kernel =
      std::string("mlxq_dequantize_into_") + dtype_tag(out_dtype) + "_b" + std::to_string(bits);
  plan.grid = Size3{D / 8, N, int64_t(B) * H};
  plan.group = elementwise_group(D / 8, N);
  plan.grid_is_threads = true;
  MlxqDequantParams& p = plan.params;
  for (int d = 0; d < 4; ++d) {
    p.w_strides[d] = w_strides[d];
    p.s_strides[d] = s_strides[d];
    p.b_strides[d] = b_strides[d];
  }
  p.B = B;
  p.H = H;
  p.N = N;
  p.D = D;
  p.group_size = group_size;
  p.bits = bits;
  p.scale_dtype = scale_dtype;
  return plan;
}

FillPlan plan_fill_u32(int64_t n_words, uint32_t pattern) {
  constexpr int kCols = 1 << 16; // words per grid row: y stays small, x fits 32 bits
  FillPlan plan;
  plan.kernel = "mlxq_fill_u32";
  const int64_t cols = std::min<int64_t>(std::max<int64_t>(n_words, 0), kCols);
  plan.grid = Size3{cols, cols > 0 ? ceil_div(n_words, cols) : 0, 1};
  plan.group = elementwise_group(cols, 1);
  plan.grid_is_threads = true;
  plan.params.n_words = n_words;
  plan.params.pattern = pattern;
  plan.params.cols = static_cast<int>(std::max<int64_t>(cols, 1));
  return plan;
}

uint32_t poison_word(int dtype) {
  switch (dtype) {
    case MQ_DT_F16:
      return 0x7E007E00u;
    case MQ_DT_BF16:
      return 0x7FC07FC0u;
    default:
      return 0x7FC00000u;
  }
}

} // namespace mlxq::metal_dispatch
