// eval_gpu of QuantizedSDPA on CUDA: problem -> plan -> bind -> launch.
// SdpaProblem::from reads the inputs; sdpa/plan.cpp (pure, tested on every
// platform) picks the tensor-core decode kernel (sdpa/decode.cuh) for a few
// query rows, cuBLAS GEMMs over key blocks (gemm_sdpa.cpp) for many rows of
// a wide head over many keys, the tensor-core tiled kernel (sdpa/tiled_*.cu)
// for other many-row calls, else the generic one (sdpa/generic.cu), with its
// grid, key splits and merge;
// this file gathers the plan's inputs, binds SdpaArgs and launches.
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "cuda/gemm_sdpa.h"
#include "cuda/launch.h"
#include "cuda/sdpa/plan.h"
#include "debug.h"
#include "environment.h"
#include "mlx/backend/cuda/utils.h"
#include "prefill_route.h"
#include "prefix_view.h"
#include "quantized_sdpa.h"
#include "sdpa_dims.h"

namespace mlxq {

namespace {

using namespace mlxq::cuda;

// Whether a 4-D array's rows can be read in 16-byte loads: an aligned base,
// contiguous rows, and every row start a multiple of 16 bytes in.
bool aligned16(const mx::array& a) {
  const auto addr = reinterpret_cast<uintptr_t>(mx::gpu_ptr<void>(a));
  const int per = 16 / int(a.itemsize()); // elements per 16 bytes
  if (addr % 16 != 0 || a.strides()[3] != 1) {
    return false;
  }
  for (int d = 0; d < 3; ++d) {
    if (a.shape(d) > 1 && a.strides()[d] % per != 0) {
      return false;
    }
  }
  return a.shape(3) % per == 0;
}

// Per-split partial outputs (o) and (max, sum) pairs (ml), scratch of one
// evaluation, in one allocation (o first; both are float arrays).
struct Partials {
  mx::array scratch{{1}, mx::float32, nullptr, {}};
  Partials(SdpaArgs& a, int64_t slots, mx::cu::CommandEncoder& enc) {
    scratch = mx::array({int(slots * (a.Dv + 2))}, mx::float32, nullptr, {});
    allocate(scratch, enc);
    a.part_o = mx::gpu_ptr<float>(scratch);
    a.part_ml = a.part_o + slots * a.Dv;
  }
};

// Log-sum-exp merge of the splits' partials into `out` (normalised, sinks).
// With `lse` (quantized_sdpa with return_lse) it writes each row's log-sum-exp too.
void merge(
    mx::cu::CommandEncoder& enc,
    SdpaArgs a,
    const Partials& parts,
    const mx::array& out,
    const mx::array* lse) {
  std::vector<mx::array> reads = {parts.scratch, out}, writes = {out};
  if (lse) {
    reads.push_back(*lse);
    writes.push_back(*lse);
  }
  launch(
      enc,
      merge_kernel(),
      dim3(a.B * a.Hkv * a.rows, (a.Dv + 31) / 32),
      dim3(kMergeThreads),
      0,
      a,
      reads,
      writes);
}

// The device's limits with the MLXQ_CUDA_* switches (csrc/environment.h)
// and the tuning overrides of tests and benchmarks.
Limits device_limits() {
  static const int sms = sm_count();
  static const int smem = max_smem_per_block();
  const Environment& e = environment();
  const Tuning& t = tuning();
  Limits l;
  l.sm_count = sms;
  l.max_smem = smem;
  l.decode_on = e.cuda_decode;
  l.tiled_on = e.cuda_tiled;
  l.dense_on = e.cuda_tiled_dense;
  l.fused_merge_on = e.cuda_fused_merge;
  l.gemm_on = e.cuda_gemm;
  l.fused_recent_on = e.cuda_fused_recent;
  if (t.cuda_gemm_min_keys > 0) {
    l.gemm_min_keys = int(t.cuda_gemm_min_keys);
  }
  if (t.cuda_gemm_block_elements > 0) {
    l.gemm_block_elements = t.cuda_gemm_block_elements;
  }
  return l;
}

// Row warps of a tiled block. Head dim 128: 8 (128 rows) measured best for
// prefill; 64 rows or fewer use 4, which leave fewer warps without rows.
// Head dim 256: 4 row warps (with their column partners 8 warps of up to 255
// registers); 512: 2 (8 warps; 4 row warps would be 16, spilling at 128).
// Tuning's cuda_tiled_warps = 4 and cuda_tiled_keys = 64 ask for the tiled
// kernel's other block shapes (8 x 32 measured best at head dim 128 on the
// H200).
int tiled_warps(int rows, int D) {
  if (const int forced = int(tuning().cuda_tiled_warps)) {
    return forced;
  }
  return D == 512 ? 2 : D == 256 ? 4 : rows <= 64 ? 4 : 8;
}

int tiled_keys() {
  return int(tuning().cuda_tiled_keys);
}

// Both tensor-core kernels index within one (batch, KV head) with 32-bit
// offsets.
bool head_fits_32bit(const SdpaProblem& p) {
  auto fits = [&](const int64_t* st, int64_t unit) {
    return (int64_t(p.N) * std::abs(st[2]) + int64_t(p.Dk) * std::abs(st[3])) * unit <
        (int64_t(1) << 31);
  };
  for (int i = 0; i < 6; ++i) {
    if (!fits(p.kv_st[i], i % 3 == 0 ? 4 : 1)) {
      return false;
    }
  }
  return true;
}

// The decode kernel reads dense rows: a key's packed words, scales and biases
// each consecutive (a cache buffer and its prefix views are; the strides of
// a size-1 dim do not matter).
bool dense_rows(const mx::array& a, int64_t row) {
  return (a.shape(2) == 1 || a.strides()[2] == row) && (a.shape(3) == 1 || a.strides()[3] == 1);
}

Layout layout_of(const std::vector<mx::array>& in, const SdpaProblem& p) {
  Layout l;
  l.vec_loads = aligned16(in[kInKPacked]) && aligned16(in[kInVPacked]);
  // Words and groups per row of K (i < 3) and V.
  const int64_t row[6] = {
      int64_t(p.Dk) * p.k_bits / 32,
      p.Dk / p.k_group_size,
      p.Dk / p.k_group_size,
      int64_t(p.Dv) * p.v_bits / 32,
      p.Dv / p.v_group_size,
      p.Dv / p.v_group_size};
  l.dense_kv = true;
  for (int i = 0; i < 6; ++i) {
    l.dense_kv = l.dense_kv && dense_rows(in[kInKPacked + i], row[i]);
  }
  l.head_fits_32bit = head_fits_32bit(p);
  l.packed_unit_stride = p.kv_st[0][3] == 1 && p.kv_st[3][3] == 1;
  return l;
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

// The plan's candidates: the instances the problem could use, with their
// occupancy (queried only for kernels that fit this device).
struct Candidates {
  DecodeKernel decode;
  TiledKernel tiled;
  DecodeShape decode_shape;
  TiledShape tiled_shape;
};

Candidates candidates_for(const SdpaProblem& p, const Layout& layout, const Limits& limits) {
  Candidates c;
  if (decode_candidate(p, layout, limits)) {
    c.decode = decode_kernel(
        p.Dk, p.k_group_size, p.k_bits, p.v_group_size, p.v_bits, p.scale_dtype, p.q_dtype);
    DecodeShape& d = c.decode_shape;
    d.available = c.decode.fn != nullptr;
    d.smem = c.decode.smem;
    d.max_rows = c.decode.max_rows;
    d.step_keys = c.decode.step_keys;
    d.merge_smem = c.decode.merge_smem;
    if (decode_fits(p, limits, d)) {
      d.blocks_per_sm = blocks_per_sm(c.decode.fn, kDecodeWarps * 32, d.smem);
      return c; // the plan takes it
    }
  }
  if (dense_tiled_candidate(p, layout, limits)) {
    c.tiled = tiled_dense_kernel(p.q_dtype, p.Dk);
    if (!c.tiled.fn || c.tiled.smem > limits.max_smem) {
      c.tiled = {}; // the codes instance below, then
    }
  }
  if (!c.tiled.fn && tiled_candidate(p, layout, limits) && p.same_quantization()) {
    c.tiled =
        tiled_kernel(p.q_dtype, p.Dk, p.k_group_size, tiled_warps(p.rows(), p.Dk), tiled_keys());
    if (c.tiled.fn && c.tiled.smem > limits.max_smem) {
      // A GPU with less shared memory (99 KB on sm_86) may still fit the
      // 2-row-warp block (head dim 256).
      const TiledKernel small = tiled_kernel(p.q_dtype, p.Dk, p.k_group_size, 2, tiled_keys());
      if (small.fn && small.smem <= limits.max_smem) {
        c.tiled = small;
      }
    }
  }
  if (c.tiled.fn) {
    TiledShape& t = c.tiled_shape;
    t.available = true;
    t.smem = c.tiled.smem;
    t.threads = c.tiled.threads;
    t.rows = c.tiled.rows;
    t.keys = c.tiled.keys;
    t.dense = c.tiled.dense;
    if (tiled_fits(limits, t)) {
      t.blocks_per_sm = blocks_per_sm(c.tiled.fn, t.threads, t.smem);
    }
  }
  return c;
}

// SdpaArgs from the problem, the arrays' device pointers and the plan.
SdpaArgs bind(
    const SdpaProblem& p,
    const Layout& layout,
    const Plan& plan,
    const std::vector<mx::array>& in,
    mx::array& out) {
  SdpaArgs a{};
  copy_dims(p, a);
  a.rep = p.rep;
  a.q_dtype = p.q_dtype;
  a.mask_kind = p.mask;
  a.q = mx::gpu_ptr<void>(in[kInQ]);
  a.kw = mx::gpu_ptr<uint32_t>(in[kInKPacked]);
  a.ks = mx::gpu_ptr<void>(in[kInKScales]);
  a.kb = mx::gpu_ptr<void>(in[kInKBiases]);
  a.vw = mx::gpu_ptr<uint32_t>(in[kInVPacked]);
  a.vs = mx::gpu_ptr<void>(in[kInVScales]);
  a.vb = mx::gpu_ptr<void>(in[kInVBiases]);
  std::copy_n(p.q_st, 4, a.q_st);
  int64_t* kv_st[6] = {a.kw_st, a.ks_st, a.kb_st, a.vw_st, a.vs_st, a.vb_st};
  for (int i = 0; i < 6; ++i) {
    std::copy_n(p.kv_st[i], 4, kv_st[i]);
  }
  if (p.mask_input >= 0) {
    a.mask = mx::gpu_ptr<void>(in[p.mask_input]);
    a.mask_dtype = p.mask_dtype;
    std::copy_n(p.m_st, 4, a.m_st);
  }
  a.sinks = p.sinks_input >= 0 ? mx::gpu_ptr<float>(in[p.sinks_input]) : nullptr;
  a.out = mx::gpu_ptr<void>(out);
  a.vec_loads = layout.vec_loads;
  a.rows = plan.rows;
  a.head_group_magic = head_group_magic(plan.head_groups);
  a.row_tile = plan.row_tile;
  a.row_tiles = plan.row_tiles;
  a.splits = plan.splits;
  a.split_keys = plan.split_keys;
  if (plan.recent_splits > 0) {
    const mx::array& rk = in[p.recent_input];
    const mx::array& rv = in[p.recent_input + 1];
    a.rk = mx::gpu_ptr<void>(rk);
    a.rv = mx::gpu_ptr<void>(rv);
    std::copy_n(p.rk_st, 4, a.rk_st);
    std::copy_n(p.rv_st, 4, a.rv_st);
    a.recent = p.recent;
    a.recent_splits = plan.recent_splits;
    a.recent_causal = p.recent_causal ? 1 : 0;
    a.recent_vec = aligned16(rk) && aligned16(rv);
  }
  return a;
}

// The decode kernel's fused-merge tickets, one per (batch, KV head).
//
// The tickets wrap back to zero at every launch's last block (see
// sdpa/merge.cuh), so each stream keeps one zeroed array and reuses it
// (stream_array): no allocation and no zeroing node per evaluation, a host
// cost that showed in the decode step. Every kernel that uses it is
// registered as writing it (the layers of a decode step are ordered by their
// data anyway).
mx::array merge_counters(mx::cu::CommandEncoder& enc, const SdpaProblem& p) {
  const int needed = p.B * p.Hkv;
  return stream_array(
      enc,
      StreamSlot::MergeCounters,
      [&](const mx::array& a) { return a.size() >= size_t(needed); },
      [&] {
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
        return counters;
      });
}

// The dense tiled kernel's K and V: both dequantized into one scratch
// allocation in the query's dtype ([2][B, Hkv, N, D]), held until the
// evaluation completes. Each copy node is also registered as writing its
// source buffers, so that a later cache write into them waits for it (see
// eval_gpu).
mx::array dense_copy(
    mx::cu::CommandEncoder& enc,
    const SdpaProblem& p,
    SdpaArgs& a,
    const std::vector<mx::array>& in,
    const mx::array& q) {
  const int64_t per = int64_t(p.B) * p.Hkv * p.N * p.Dk; // (Dk == Dv: the plan's candidates)
  mx::array scratch({int(2 * per)}, q.dtype(), nullptr, {});
  allocate(scratch, enc);
  char* base = static_cast<char*>(mx::gpu_ptr<void>(scratch));
  for (int side = 0; side < 2; ++side) {
    const int w = side == 0 ? kInKPacked : kInVPacked;
    void* dst = base + side * per * q.itemsize();
    const int bits = side == 0 ? p.k_bits : p.v_bits;
    const int group = side == 0 ? p.k_group_size : p.v_group_size;
    DequantLaunch l =
        dequantize_launch(in[w], in[w + 1], in[w + 2], dst, p.q_dtype, p.Dk, group, bits);
    launch(
        enc,
        l.kernel,
        l.grid,
        l.block,
        0,
        l.args,
        {&in[w], &in[w + 1], &in[w + 2], &scratch},
        {&scratch, &in[w], &in[w + 1], &in[w + 2]});
    (side == 0 ? a.kd : a.vd) = dst;
  }
  return scratch;
}

void* kernel_of(const Plan& plan, const Candidates& c, const SdpaProblem& p) {
  switch (plan.family) {
    case Family::Decode:
      return c.decode.fn;
    case Family::Tiled:
      return c.tiled.fn;
    default:
      return generic_kernel(p.k_bits, p.v_bits);
  }
}

// Attention of problem p into `out` (allocated), with each row's
// log-sum-exp into `lse` when p.with_lse: plan, bind, launch.
void attend(
    mx::cu::CommandEncoder& enc,
    const std::vector<mx::array>& in,
    const SdpaProblem& p,
    mx::array& out,
    mx::array* lse);

// A window the plan's kernel does not attend (another family than decode,
// or MLXQ_CUDA_FUSED_RECENT=0): the quantized keys with their log-sum-exp
// into scratch, then RecentAttention's kernel merges the window in.
void attend_then_merge_recent(
    mx::cu::CommandEncoder& enc,
    const std::vector<mx::array>& in,
    const SdpaProblem& p,
    mx::array& out) {
  SdpaProblem quantized = p;
  quantized.recent = 0;
  quantized.recent_input = -1;
  quantized.with_lse = true;
  mx::array out_q(out.shape(), out.dtype(), nullptr, {});
  mx::array lse_q({p.B, p.Hq, p.L}, mx::float32, nullptr, {});
  allocate(out_q, enc);
  allocate(lse_q, enc);
  poison(out_q, enc);
  poison(lse_q, enc);
  attend(enc, in, quantized, out_q, &lse_q);
  launch_recent(
      enc,
      in[kInQ],
      in[p.recent_input],
      in[p.recent_input + 1],
      out_q,
      lse_q,
      out,
      p.scale,
      p.recent_causal);
  note_sdpa_kernel("cuda_recent");
}

void attend(
    mx::cu::CommandEncoder& enc,
    const std::vector<mx::array>& in,
    const SdpaProblem& p,
    mx::array& out,
    mx::array* lse) {
  const Limits limits = device_limits();
  const Layout layout = layout_of(in, p);
  const Candidates c = candidates_for(p, layout, limits);
  const int generic_smem = generic_smem_bytes(p.Dk, p.Dv, p.k_bits, p.v_bits);
  const Plan plan = plan_sdpa(p, layout, limits, c.decode_shape, c.tiled_shape, generic_smem);
  if (p.recent > 0 && plan.recent_splits == 0) {
    attend_then_merge_recent(enc, in, p, out);
    return;
  }
  // A decode plan of several query-head groups per KV head runs as that
  // many times the KV heads (the kernel maps them back for K/V).
  const SdpaProblem bound = plan.head_groups > 1 ? grouped(p, plan.head_groups) : p;
  SdpaArgs a = bind(bound, layout, plan, in, out);
  a.lse = lse ? mx::gpu_ptr<float>(*lse) : nullptr;
  void* kernel = kernel_of(plan, c, p);
  if (plan.family == Family::Generic) {
    cuFuncSetAttribute(
        static_cast<CUfunction>(kernel),
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        plan.smem);
  }
  mx::array counters({1}, mx::uint32, nullptr, {});
  if (plan.fused_merge) {
    counters = merge_counters(enc, bound);
    a.counters = mx::gpu_ptr<unsigned>(counters);
  }
  // The dense tiled kernel's copies of K and V come first; the attention
  // node reads them (so it runs after both copy nodes) and every input.
  mx::array dense({1}, mx::float32, nullptr, {});
  if (plan.dense_copy) {
    dense = dense_copy(enc, p, a, in, in[kInQ]);
    if (plan.family == Family::Gemm) {
      note_sdpa_kernel(family_name(plan.family));
      eval_gemm(enc, p, plan, in, dense, a.kd, a.vd, out, lse);
      return;
    }
    enc.set_input_array(dense);
  }
  for (const auto& x : in) {
    enc.set_input_array(x);
  }
  // The next node (every path's first, the kernel that reads K/V) is also
  // registered as writing the K/V buffers. MLX orders graph nodes only after
  // the last writer of each buffer, and caches write their buffers in place
  // (QuantizedKVUpdate): this makes a later write into rows this kernel
  // reads, in the same graph, wait for it.
  for (int i = kInKPacked; i <= kInVBiases; ++i) {
    enc.set_output_array(in[i]);
  }
  note_sdpa_kernel(plan.dense_copy ? "cuda_tiled_dense" : family_name(plan.family));
  const dim3 grid(unsigned(plan.grid[0]), unsigned(plan.grid[1]), unsigned(plan.grid[2]));
  if (!plan.merge_kernel && !plan.fused_merge) {
    // `out` is read too: the kernel must run after the poisoning fill.
    launch(enc, kernel, grid, dim3(plan.threads), plan.smem, a, {&out}, {&out});
    return;
  }
  Partials parts(a, plan.partial_slots, enc);
  if (plan.fused_merge) {
    std::vector<mx::array> reads = {counters, out}, writes = {parts.scratch, out, counters};
    if (lse) {
      reads.push_back(*lse);
      writes.push_back(*lse);
    }
    launch(enc, kernel, grid, dim3(plan.threads), plan.smem, a, reads, writes);
    return;
  }
  launch(enc, kernel, grid, dim3(plan.threads), plan.smem, a, {&out}, {&parts.scratch});
  merge(enc, a, parts, out, lse);
}

} // namespace

void QuantizedSDPA::eval_gpu(const std::vector<mx::array>& given, std::vector<mx::array>& outs) {
  const auto in = detail::with_prefix_rows(given, 1, 6, params_.rows);
  mx::array& out = outs[0];
  auto& enc = mx::cu::get_command_encoder(stream());
  allocate(out, enc);
  poison(out, enc);
  // The log-sum-exp (quantized_sdpa with return_lse), written by the split merge.
  mx::array* lse = outs.size() > 1 ? &outs[1] : nullptr;
  if (lse) {
    allocate(*lse, enc);
    poison(*lse, enc);
  }
  const SdpaProblem p = SdpaProblem::from(in, params_, out);
  if (p.empty()) {
    return;
  }
  attend(enc, in, p, out, lse);
}

GpuBackend gpu_backend() {
  return GpuBackend::Cuda;
}

} // namespace mlxq
