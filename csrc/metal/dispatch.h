// Grid arithmetic of mlxq's Metal kernels: which kernel, how many key blocks,
// threadgroup and grid sizes, partial-buffer sizes and the argument block.
//
// Plain C++ with no Metal dependency: compiled on every platform, called by
// the Metal host code (csrc/metal/*.cpp) and, through mlxq._ext's
// `_metal_plan_*` bindings, by the emulator tests (tests/metal), so the
// kernels run under the emulator exactly as they are dispatched on a Mac.
#pragma once

#include <cstdint>
#include <string>

#include "mlxq_params.h"

namespace mlxq::metal_dispatch {

// Buffer indices ([[buffer(n)]]) of each kernel family.
namespace slots {
// mlxq_qsdpa_decode_* / mlxq_qsdpa_prefill_* (prefill has no partials)
constexpr int kQ = 0, kKPacked = 1, kKScales = 2, kKBiases = 3, kVPacked = 4, kVScales = 5,
              kVBiases = 6, kMask = 7, kSinks = 8, kOut = 9, kPartialO = 10, kPartialML = 11,
              kSdpaParams = 12;
// mlxq_qsdpa_merge_*
constexpr int kMergePartialO = 0, kMergePartialML = 1, kMergeSinks = 2, kMergeOut = 3,
              kMergeParams = 4, kMergeLse = 5;
// mlxq_ring_update_*
constexpr int kRingUpdate = 0, kRingPos = 1, kRingOut = 2, kRingParams = 3;
// mlxq_quantized_ring_update_* (one dispatch writes one part: its array is
// bound to that part's slot, and to the two others, which it leaves alone)
constexpr int kQRingUpdate = 0, kQRingPos = 1, kQRingPacked = 2, kQRingScales = 3, kQRingBiases = 4,
              kQRingParams = 5;
// mlxq_copy4d_*
constexpr int kCopySrc = 0, kCopyDst = 1, kCopyParams = 2;
// mlxq_dequantize_into_* and mlxq_fill_u32. kDqOrder / kFillOrder take the
// workspace and the `after` inputs, one after another: the kernels never
// read that slot; binding them there lets MLX's encoder order the dispatch
// after their writers (a barrier).
constexpr int kDqPacked = 0, kDqScales = 1, kDqBiases = 2, kDqOut = 3, kDqParams = 4, kDqOrder = 5;
constexpr int kFillDst = 0, kFillParams = 1, kFillOrder = 2;
} // namespace slots

struct Size3 {
  int64_t x = 1, y = 1, z = 1;
  bool empty() const {
    return x <= 0 || y <= 0 || z <= 0;
  }
};

enum class SdpaMode { Auto = 0, Decode = 1, Prefill = 2 };

// Defaults of the decode split (overridable for tests).
constexpr int kTargetThreadgroups = 256; // enough to fill the largest Apple GPUs
constexpr int kMinBlockKeys = 64; // keys per block at least
constexpr int kMaxBlocks = 1024;
constexpr int kPrefillMinL = 16; // shortest query run that uses prefill
constexpr int kMergeSimdGroups = 4; // rows per merge threadgroup

struct SdpaProblem {
  int B = 1, Hq = 1, Hkv = 1, L = 1, N = 0, Dk = 0, Dv = 0;
  int k_group_size = 64, k_bits = 4;
  int v_group_size = 64, v_bits = 4;
  int q_dtype = MQ_DT_F32; // also the output dtype
  int scale_dtype = MQ_DT_F32; // scales and biases of K and V
  int mask_kind = MQ_MASK_NONE;
  int mask_dtype = MQ_DT_BOOL; // of an array mask
  bool has_sinks = false;
  float scale = 1.0f;
  // Strides in elements. K/V: [packed, scales, biases] x [B, Hkv, N].
  int64_t q_strides[4] = {0, 0, 0, 1};
  int64_t k_strides[3][3] = {};
  int64_t v_strides[3][3] = {};
  int64_t k_packed_offset = 0; // element offset of the packed views (for
  int64_t v_packed_offset = 0; // the 16-byte load alignment check)
  // Whether the packed arrays' buffer bases are 16-byte aligned. MTLBuffer
  // bases normally are (page or heap aligned); the host checks rather than
  // assumes, and a misaligned base takes the scalar path.
  bool k_base_aligned16 = true;
  bool v_base_aligned16 = true;
  int64_t m_strides[4] = {};
  int64_t sinks_stride = 1;
  SdpaMode mode = SdpaMode::Auto;
  // Also each row's log-sum-exp: the decode kernel then always writes
  // partials and the merge writes both (never the prefill kernel, which
  // normalises in place).
  bool with_lse = false;
  int target_threadgroups = kTargetThreadgroups;
  int min_block_keys = kMinBlockKeys;
  // The pipeline's maxTotalThreadsPerThreadgroup: caps the rows (SIMD groups)
  // of a threadgroup.
  int max_threads = 1024;
};

struct SdpaPlan {
  // mlxq_qsdpa_{decode,prefill}_<q dtype>_<widths>_d<128|512>, widths b<bits>,
  // k8v4 or kv (sdpa_widths_tag)
  std::string kernel;
  Size3 grid; // threadgroups per grid (dispatch_threadgroups)
  Size3 group; // threads per threadgroup
  bool prefill = false;
  bool merge = false; // a merge pass follows (decode with > 1 key block)
  std::string merge_kernel;
  Size3 merge_grid, merge_group;
  int64_t partial_o_floats = 0; // f32 elements of the partial buffers
  int64_t partial_ml_floats = 0;
  MlxqSdpaParams params{};
};

SdpaPlan plan_sdpa(const SdpaProblem& pr);

// The widths part of an attention kernel's name: b<bits> when K and V share
// one, k8v4, or kv (a kernel that reads both widths at run time).
std::string sdpa_widths_tag(int k_bits, int v_bits);

// Ring updates and the strided copy. `grid_is_threads`: dispatch_threads
// (grid counts threads) rather than dispatch_threadgroups.
struct ElementwisePlan {
  std::string kernel;
  Size3 grid, group;
  bool grid_is_threads = true;
};

struct RingPlan : ElementwisePlan {
  MlxqRingParams params{};
};

struct CopyPlan : ElementwisePlan {
  MlxqCopyParams params{};
};

// Buffer [B, H, S, D] of `itemsize`-byte elements, update [B, H, T, D].
RingPlan
plan_ring_update(int B, int H, int S, int T, int D, int itemsize, const int64_t upd_strides[4]);

// Update [B, H, T, D] in `dtype` (MQ_DT_*), quantized into rows of S;
// `part` (MQ_PART_*) is the array of the triple this dispatch writes.
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
    const int64_t upd_strides[4]);

// A strided [s0, s1, s2, s3] array of `itemsize`-byte elements into a
// row-contiguous one.
CopyPlan plan_copy4d(const int shape[4], const int64_t strides[4], int itemsize);

struct DequantPlan : ElementwisePlan {
  MlxqDequantParams params{};
};

struct FillPlan : ElementwisePlan {
  MlxqFillParams params{};
};

// DequantizeInto of packed [B, H, N, D * bits / 32] and scales / biases
// [B, H, N, D / group_size] in `scale_dtype` into a row-contiguous
// [B, H, N, D] output in `out_dtype` (MQ_DT_*): one thread per 8 codes of
// a row, grid (D / 8, N, B * H) threads. Strides in elements.
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
    const int64_t b_strides[4]);

// `n_words` 32-bit words set to `pattern`, one thread per word.
FillPlan plan_fill_u32(int64_t n_words, uint32_t pattern);

// The poison word of an output in `dtype` (MQ_DT_*): a quiet NaN in every
// element (debug.h's poisoning, made on the GPU).
uint32_t poison_word(int dtype);

// "f32", "f16", "bf16" for MQ_DT_*.
const char* dtype_tag(int dtype);

} // namespace mlxq::metal_dispatch
