// eval_gpu of QuantizedSDPA on CUDA: plans the grid and launches the kernels
// of quantized_sdpa.cu (see the comment there for the algorithm).
#include <cuda.h>

#include <algorithm>

#include "cuda/launch.h"
#include "mlx/backend/cuda/utils.h"
#include "quantized_sdpa.h"
#include "sdpa_plan.h"

namespace mlxq {

namespace {

using namespace mlxq::cuda;

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
  const auto p = plan_sdpa(a.B, a.Hkv, a.rep, a.L, a.N, kMaxTileRows,
                           4L * sm_count(), 4 * kTileKeys, kTileKeys);
  a.rows = p.rows;
  a.row_tile = p.row_tile;
  a.row_tiles = p.row_tiles;
  a.splits = p.splits;
  a.split_keys = p.split_keys;
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

  mx::array part_o({1}, mx::float32, nullptr, {});
  mx::array part_ml({1}, mx::float32, nullptr, {});
  if (a.splits > 1) {
    const long blocks = long(a.B) * a.Hkv * a.row_tiles * a.splits;
    part_o = mx::array({int(blocks * a.row_tile * a.Dv)}, mx::float32, nullptr, {});
    part_ml = mx::array({int(blocks * a.row_tile * 2)}, mx::float32, nullptr, {});
    allocate(part_o, enc);
    allocate(part_ml, enc);
    enc.add_temporary(part_o);
    enc.add_temporary(part_ml);
    a.part_o = mx::gpu_ptr<float>(part_o);
    a.part_ml = mx::gpu_ptr<float>(part_ml);
  }

  void* kernel = sdpa_kernel(a.bits);
  const int smem = sdpa_smem_bytes(a.Dk, a.Dv, a.bits);
  cuFuncSetAttribute(static_cast<CUfunction>(kernel),
                     CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
  for (const auto& x : in) {
    enc.set_input_array(x);
  }
  // `out` is read too: the kernel must run after the poisoning fill.
  if (a.splits > 1) {
    launch(enc, kernel, dim3(a.splits, a.Hkv * a.row_tiles, a.B),
           dim3(kBlockThreads), smem, a, {&out}, {&part_o, &part_ml});
  } else {
    launch(enc, kernel, dim3(a.splits, a.Hkv * a.row_tiles, a.B),
           dim3(kBlockThreads), smem, a, {&out}, {&out});
  }
  if (a.splits > 1) {
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
    launch(enc, merge_kernel(), dim3(a.B * a.Hkv * a.rows), dim3(kBlockThreads), 0, m,
           {&part_o, &part_ml, &out}, {&out});
  }
}

} // namespace mlxq
