// eval_gpu of QuantizedSDPA on CUDA: picks the tensor-core decode kernel
// (sdpa/decode.cuh) for a few query rows, the tensor-core tiled
// kernel (sdpa/tiled_*.cu) for many, else the generic one
// (sdpa/generic.cu); plans the grid and merges the key splits.
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>

#include "cuda/launch.h"
#include "debug.h"
#include "mlx/backend/cuda/utils.h"
#include "quantized_sdpa.h"
#include "sdpa_plan.h"

namespace mlxq {

namespace {

using namespace mlxq::cuda;

static_assert(
    int(MaskKind::None) == kMaskNone && int(MaskKind::Causal) == kMaskCausal &&
        int(MaskKind::Array) == kMaskArray,
    "the CUDA kernels' mask codes are MaskKind's values");

bool aligned16(const mx::array& a) {
  const auto addr = reinterpret_cast<uintptr_t>(mx::gpu_ptr<void>(a));
  if (addr % 16 != 0 || a.strides()[3] != 1) {
    return false;
  }
  for (int d = 0; d < 3; ++d) {
    if (a.shape(d) > 1 && a.strides()[d] % 4 != 0) {
      return false;
    }
  }
  return a.shape(3) % 4 == 0;
}

// Enough blocks for a few per SM at any N (decode splits keys), in whole
// tiles of at least 4 x kTileKeys keys per split.
void plan(SdpaArgs& a) {
  const auto p = plan_sdpa(
      a.B, a.Hkv, a.rep, a.L, a.N, kMaxTileRows, 4L * sm_count(), 4 * kTileKeys, kTileKeys);
  a.rows = p.rows;
  a.row_tile = p.row_tile;
  a.row_tiles = p.row_tiles;
  a.splits = p.splits;
  a.split_keys = p.split_keys;
}

// Per-split partial outputs (o) and (max, sum) pairs (ml), scratch of one
// evaluation, in one allocation (o first; both are float arrays).
struct Partials {
  mx::array scratch{{1}, mx::float32, nullptr, {}};
  Partials(SdpaArgs& a, mx::cu::CommandEncoder& enc) {
    const long slots = long(a.B) * a.Hkv * a.row_tiles * a.splits * a.row_tile;
    scratch = mx::array({int(slots * (a.Dv + 2))}, mx::float32, nullptr, {});
    allocate(scratch, enc);
    a.part_o = mx::gpu_ptr<float>(scratch);
    a.part_ml = a.part_o + slots * a.Dv;
  }
};

// Log-sum-exp merge of the splits' partials into `out` (normalised, sinks).
void merge(mx::cu::CommandEncoder& enc, const SdpaArgs& a, const Partials& parts, mx::array& out) {
  MergeArgs m{};
  m.part_o = a.part_o;
  m.part_ml = a.part_ml;
  m.sinks = a.sinks;
  m.out = a.out;
  m.B = a.B;
  m.Hq = a.Hq;
  m.Hkv = a.Hkv;
  m.L = a.L;
  m.Dv = a.Dv;
  m.rep = a.rep;
  m.rows = a.rows;
  m.row_tile = a.row_tile;
  m.row_tiles = a.row_tiles;
  m.splits = a.splits;
  m.out_dtype = a.q_dtype;
  launch(
      enc,
      merge_kernel(),
      dim3(a.B * a.Hkv * a.rows, (a.Dv + 31) / 32),
      dim3(kMergeThreads),
      0,
      m,
      {&parts.scratch, &out},
      {&out});
}

// Launches a kernel that writes `out` itself (one split) or, with several
// splits, per-split partials that merge() then combines into `out`.
void launch_split(
    mx::cu::CommandEncoder& enc,
    void* kernel,
    dim3 grid,
    int threads,
    int smem,
    SdpaArgs& a,
    mx::array& out) {
  if (a.splits == 1) {
    // `out` is read too: the kernel must run after the poisoning fill.
    launch(enc, kernel, grid, dim3(threads), smem, a, {&out}, {&out});
    return;
  }
  Partials parts(a, enc);
  launch(enc, kernel, grid, dim3(threads), smem, a, {&out}, {&parts.scratch});
  merge(enc, a, parts, out);
}

// MLXQ_CUDA_DECODE=0 / MLXQ_CUDA_TILED=0 turn the tensor-core decode / tiled
// kernels off (for comparisons); MLXQ_CUDA_TILED_WARPS=4 and
// MLXQ_CUDA_TILED_KEYS=64 ask for the tiled kernel's other block shapes
// (8 x 32 measured best at head dim 128 on the H200).
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

bool decode_allowed() {
  static const bool on = env_int("MLXQ_CUDA_DECODE", 1) != 0;
  return on;
}

bool tiled_allowed() {
  static const bool on = env_int("MLXQ_CUDA_TILED", 1) != 0;
  return on;
}

// 8-warp blocks (128 rows) measured best for prefill; 64 rows or fewer use
// 4-warp blocks, which leave fewer warps without rows.
int tiled_warps(int rows) {
  static const int forced = env_int("MLXQ_CUDA_TILED_WARPS", 0);
  return forced ? forced : rows <= 64 ? 4 : 8;
}

int tiled_keys() {
  static const int keys = env_int("MLXQ_CUDA_TILED_KEYS", 32);
  return keys;
}

// Both tensor-core kernels index within one (batch, KV head) with 32-bit
// offsets.
bool head_fits_32bit(const SdpaArgs& a) {
  auto fits = [&](const int64_t* st, int64_t unit) {
    return (int64_t(a.N) * std::abs(st[2]) + int64_t(a.Dk) * std::abs(st[3])) * unit <
        (int64_t(1) << 31);
  };
  return fits(a.kw_st, 4) && fits(a.vw_st, 4) && fits(a.ks_st, 1) && fits(a.kb_st, 1) &&
      fits(a.vs_st, 1) && fits(a.vb_st, 1);
}

// The decode kernel reads dense rows: a key's packed words, scales and biases
// each consecutive (a cache buffer and its prefix views are; the strides of
// a size-1 dim do not matter).
bool dense_rows(const mx::array& a, int64_t row) {
  return (a.shape(2) == 1 || a.strides()[2] == row) && (a.shape(3) == 1 || a.strides()[3] == 1);
}

bool dense_kv(const std::vector<mx::array>& in, const SdpaArgs& a) {
  const int64_t words = int64_t(a.Dk) * a.bits / 32, groups = a.Dk / a.gs;
  return dense_rows(in[1], words) && dense_rows(in[4], words) && dense_rows(in[2], groups) &&
      dense_rows(in[3], groups) && dense_rows(in[5], groups) && dense_rows(in[6], groups);
}

DecodeKernel decode_kernel_for(const std::vector<mx::array>& in, const SdpaArgs& a) {
  const bool half_q = a.q_dtype == kF16 || a.q_dtype == kBF16;
  if (!decode_allowed() || !half_q || a.Dk != a.Dv || a.mask_kind == kMaskArray || !a.vec_loads ||
      a.N < 1 || !head_fits_32bit(a) || !dense_kv(in, a)) {
    return {};
  }
  const DecodeKernel k = decode_kernel(a.bits, a.Dk, a.gs, a.s_dtype, a.q_dtype);
  // 8-bit codes at head dim 256 need more shared memory than GPUs with 99 KB
  // per block have: those take the other kernels.
  return a.rep * a.L <= k.max_rows && k.smem <= max_smem_per_block() ? k : DecodeKernel{};
}

// The tiled kernel for many query rows: f16/bf16 queries, Dk = Dv, packed
// words with unit stride along the row.
TiledKernel tiled_kernel_for(const SdpaArgs& a) {
  const bool half_q = a.q_dtype == kF16 || a.q_dtype == kBF16;
  if (!tiled_allowed() || !half_q || a.Dk != a.Dv || a.rows <= kMaxTileRows || a.N < 1 ||
      a.kw_st[3] != 1 || a.vw_st[3] != 1 || !head_fits_32bit(a)) {
    return {};
  }
  const TiledKernel k = tiled_kernel(a.q_dtype, a.Dk, a.gs, tiled_warps(a.rows), tiled_keys());
  return k.smem <= max_smem_per_block() ? k : TiledKernel{};
}

// Blocks of a kernel that fit on one SM (one wave: a second, partial wave
// would leave most SMs idle while it runs). Sets the kernel's shared-memory
// limit the first time; both are cached per kernel.
int blocks_per_sm(void* kernel, int threads, int smem) {
  static std::mutex mutex;
  static std::unordered_map<void*, int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(kernel);
  if (it != cache.end()) {
    return it->second;
  }
  const auto fn = static_cast<CUfunction>(kernel);
  cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
  int per_sm = 0;
  if (cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem) != CUDA_SUCCESS ||
      per_sm < 1) {
    per_sm = 1;
  }
  cache.emplace(kernel, per_sm);
  return per_sm;
}

// MLXQ_CUDA_FUSED_MERGE=0 leaves the decode kernel's split merge to
// merge_kernel (for comparisons).
bool fused_merge_allowed() {
  static const bool on = env_int("MLXQ_CUDA_FUSED_MERGE", 1) != 0;
  return on;
}

// The tensor-core decode path's grid: one partial per block of kDecodeWarps
// warps, splits of whole warp steps, enough blocks for a few per SM at any N.
void plan_decode(const DecodeKernel& k, SdpaArgs& a) {
  const long units = long(a.B) * a.Hkv;
  const long want = long(blocks_per_sm(k.fn, kDecodeWarps * 32, k.smem)) * sm_count();
  long splits = std::max(1L, (want + units - 1) / units);
  splits = std::min<long>(splits, (a.N + k.step_keys - 1) / k.step_keys);
  int keys = int((a.N + splits - 1) / splits);
  keys = (keys + k.step_keys - 1) / k.step_keys * k.step_keys;
  a.row_tile = a.rows; // plan() set rows = rep * L
  a.row_tiles = 1;
  a.split_keys = keys;
  a.splits = (a.N + keys - 1) / keys;
}

// Tickets of the decode kernel's fused merge, one per (batch, KV head), when
// its weights fit the kernel's shared memory and one block can fold a head's
// partials quickly: with few KV heads the splits multiply and merge_kernel's
// many blocks win (128 KB: 32/8/128 at 128k keys folds 100 KB per head,
// measured faster fused).
//
// The tickets wrap back to zero at every launch's last block (see
// sdpa/merge.cuh), so each stream keeps one zeroed array and reuses it: no
// allocation and no zeroing node per evaluation, a host cost that showed in
// the decode step. Every kernel that uses it is registered as writing it, so
// MLX orders those kernels one after another within a graph (the layers of
// a decode step are ordered by their data anyway); graphs of one stream run
// in order.
mx::array merge_counters(mx::cu::CommandEncoder& enc, const DecodeKernel& k, SdpaArgs& a) {
  const long head_partials = long(a.splits) * a.rows * a.Dv * 4;
  if (!fused_merge_allowed() || (long(a.splits) * a.rows + a.rows) * 4 > k.merge_smem ||
      head_partials > 128 * 1024) {
    return mx::array({1}, mx::uint32, nullptr, {});
  }
  static std::mutex mutex;
  // By (device, CUDA stream): the handles a kernel of this stream runs on.
  static auto* per_stream = new std::map<std::pair<int, const void*>, mx::array>();
  const std::pair<int, const void*> key{
      enc.device().cuda_device(), static_cast<cudaStream_t>(enc.stream())};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = per_stream->find(key);
  const int needed = a.B * a.Hkv;
  if (it == per_stream->end() || it->second.size() < size_t(needed)) {
    mx::array counters({std::max(needed, 256)}, mx::uint32, nullptr, {});
    allocate(counters, enc);
    FillArgs zero{mx::gpu_ptr<void>(counters), int64_t(counters.size()), 0u};
    launch(
        enc,
        fill_kernel(),
        dim3(unsigned(counters.size() + 255) / 256),
        dim3(256),
        0,
        zero,
        {},
        {&counters});
    it = per_stream->insert_or_assign(key, counters).first;
  }
  enc.add_temporary(it->second); // a replaced array outlives its last kernel
  a.counters = mx::gpu_ptr<unsigned>(it->second);
  return it->second;
}

void eval_decode(
    mx::cu::CommandEncoder& enc,
    const DecodeKernel& k,
    SdpaArgs& a,
    const mx::array& counters,
    mx::array& out) {
  Partials parts(a, enc);
  if (a.counters) {
    launch(
        enc,
        k.fn,
        dim3(a.splits, a.Hkv, a.B),
        dim3(kDecodeWarps * 32),
        k.smem,
        a,
        {&counters, &out},
        {&parts.scratch, &out, &counters});
    return;
  }
  launch(
      enc,
      k.fn,
      dim3(a.splits, a.Hkv, a.B),
      dim3(kDecodeWarps * 32),
      k.smem,
      a,
      {},
      {&parts.scratch});
  merge(enc, a, parts, out);
}

// The tiled path: row tiles of k.rows, keys split only while the row tiles
// alone leave SMs idle (few rows over many keys).
void eval_tiled(mx::cu::CommandEncoder& enc, const TiledKernel& k, SdpaArgs& a, mx::array& out) {
  const long want = long(blocks_per_sm(k.fn, k.threads, k.smem)) * sm_count();
  const auto p = plan_sdpa(a.B, a.Hkv, a.rep, a.L, a.N, k.rows, want / k.parts, 256, k.keys);
  a.row_tile = p.row_tile;
  a.row_tiles = p.row_tiles;
  a.splits = p.splits;
  a.split_keys = p.split_keys;
  launch_split(
      enc, k.fn, dim3(a.Hkv * a.row_tiles, a.splits * k.parts, a.B), k.threads, k.smem, a, out);
}

} // namespace

void QuantizedSDPA::eval_gpu(const std::vector<mx::array>& in, mx::array& out) {
  auto& enc = mx::cu::get_command_encoder(stream());
  allocate(out, enc);
  poison(out, enc);

  SdpaArgs a{};
  const auto& q = in[0];
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.L = q.shape(2);
  a.Dk = q.shape(3);
  a.Hkv = in[1].shape(1);
  a.N = in[1].shape(2);
  a.Dv = out.shape(3);
  a.rep = a.Hq / a.Hkv;
  a.gs = params_.group_size;
  a.bits = params_.bits;
  a.scale = params_.scale;
  a.q_dtype = dtype_code(q.dtype());
  a.s_dtype = dtype_code(in[2].dtype());
  a.mask_kind = static_cast<int>(params_.mask);
  a.q = mx::gpu_ptr<void>(q);
  a.kw = mx::gpu_ptr<uint32_t>(in[1]);
  a.ks = mx::gpu_ptr<void>(in[2]);
  a.kb = mx::gpu_ptr<void>(in[3]);
  a.vw = mx::gpu_ptr<uint32_t>(in[4]);
  a.vs = mx::gpu_ptr<void>(in[5]);
  a.vb = mx::gpu_ptr<void>(in[6]);
  copy_strides(q, a.q_st);
  copy_strides(in[1], a.kw_st);
  copy_strides(in[2], a.ks_st);
  copy_strides(in[3], a.kb_st);
  copy_strides(in[4], a.vw_st);
  copy_strides(in[5], a.vs_st);
  copy_strides(in[6], a.vb_st);
  size_t next = 7;
  if (params_.mask == MaskKind::Array) {
    a.mask = mx::gpu_ptr<void>(in[next]);
    a.mask_dtype = dtype_code(in[next].dtype());
    copy_strides(in[next], a.m_st);
    ++next;
  }
  a.sinks = params_.has_sinks ? mx::gpu_ptr<float>(in[next]) : nullptr;
  a.out = mx::gpu_ptr<void>(out);
  a.vec_loads = aligned16(in[1]) && aligned16(in[4]);
  if (a.B == 0 || a.Hq == 0 || a.L == 0) {
    return;
  }
  plan(a);

  const DecodeKernel mk = decode_kernel_for(in, a);
  mx::array counters({1}, mx::uint32, nullptr, {});
  if (mk.fn) {
    plan_decode(mk, a);
    counters = merge_counters(enc, mk, a);
  }
  for (const auto& x : in) {
    enc.set_input_array(x);
  }
  // The next node (every path's first, the kernel that reads K/V) is also
  // registered as writing the K/V buffers. MLX orders graph nodes only after
  // the last writer of each buffer, and caches write their buffers in place
  // (QuantizedKVUpdate): this makes a later write into rows this kernel
  // reads, in the same graph, wait for it.
  for (int i = 1; i <= 6; ++i) {
    enc.set_output_array(in[i]);
  }
  if (mk.fn) {
    note_sdpa_kernel("cuda_decode");
    eval_decode(enc, mk, a, counters, out);
    return;
  }
  if (const TiledKernel k = tiled_kernel_for(a); k.fn) {
    note_sdpa_kernel("cuda_tiled");
    eval_tiled(enc, k, a, out);
    return;
  }
  note_sdpa_kernel("cuda_generic");
  void* kernel = generic_kernel(a.bits);
  const int smem = generic_smem_bytes(a.Dk, a.Dv, a.bits);
  cuFuncSetAttribute(
      static_cast<CUfunction>(kernel), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
  launch_split(enc, kernel, dim3(a.Hkv * a.row_tiles, a.splits, a.B), kBlockThreads, smem, a, out);
}

} // namespace mlxq
