#include "metal/kernels.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "sdpa_problem.h"

namespace mlxq::metal_host {

namespace {

// Directory of the binary this code is linked into (mlxq/_ext*.so): the
// metallib is installed beside it.
const std::string& binary_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&binary_dir), &info)) {
      throw std::runtime_error("[mlxq.metal] cannot locate the mlxq extension on disk.");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

} // namespace

MTL::ComputePipelineState* kernel(mx::metal::Device& d, const std::string& name) {
  // Loads <binary_dir>/mlxq.metallib once; MLX caches library and pipelines.
  auto* lib = d.get_library("mlxq", binary_dir());
  auto* pipeline = d.get_kernel(name, lib);
  // Every kernel is written for 32-wide SIMD groups (simd_sum, lane = thread
  // index % 32, one SIMD group per row) and at least one full SIMD group per
  // threadgroup.
  const auto width = pipeline->threadExecutionWidth();
  const auto max_threads = pipeline->maxTotalThreadsPerThreadgroup();
  if (width != 32 || max_threads < 32) {
    throw std::runtime_error(
        "[mlxq.metal] kernel " + name +
        " needs 32-wide SIMD groups and at least 32 "
        "threads per threadgroup; this GPU's pipeline has SIMD width " +
        std::to_string(width) + " and at most " + std::to_string(max_threads) + " threads.");
  }
  return pipeline;
}

bool base_aligned16(const mx::array& a) {
  const auto* base = static_cast<const char*>(a.buffer().raw_ptr());
  return reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

void dispatch(
    mx::metal::CommandEncoder& enc,
    const md::Size3& grid,
    const md::Size3& group,
    bool grid_is_threads) {
  if (grid.empty()) {
    return;
  }
  const MTL::Size g(grid.x, grid.y, grid.z);
  const MTL::Size t(group.x, group.y, group.z);
  if (grid_is_threads) {
    enc.dispatch_threads(g, t);
  } else {
    enc.dispatch_threadgroups(g, t);
  }
}

int dtype_code(mx::Dtype t) {
  static_assert(
      MQ_DT_F32 == kF32 && MQ_DT_F16 == kF16 && MQ_DT_BF16 == kBF16 && MQ_DT_BOOL == kBool,
      "metal/mlxq_params.h's element codes are sdpa_codes.h's");
  static_assert(
      MQ_MASK_NONE == kMaskNone && MQ_MASK_CAUSAL == kMaskCausal && MQ_MASK_ARRAY == kMaskArray,
      "metal/mlxq_params.h's mask kinds are sdpa_codes.h's");
  const DtypeCode c = mlxq::dtype_code(t);
  return c == kBool ? MQ_DT_F32 : c; // the kernels read floats only
}

void copy4d(const mx::array& src, mx::array& dst, const mx::Stream& s) {
  int shape[4];
  int64_t strides[4];
  for (int i = 0; i < 4; ++i) {
    shape[i] = src.shape(i);
    strides[i] = src.strides()[i];
  }
  const md::CopyPlan plan = md::plan_copy4d(shape, strides, static_cast<int>(src.itemsize()));
  if (plan.grid.empty()) {
    return;
  }
  auto& d = mx::metal::device(s.device);
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(kernel(d, plan.kernel));
  enc.set_input_array(src, md::slots::kCopySrc);
  enc.set_output_array(dst, md::slots::kCopyDst);
  enc.set_bytes(plan.params, md::slots::kCopyParams);
  dispatch(enc, plan.grid, plan.group, plan.grid_is_threads);
}

mx::array rows_contiguous(const mx::array& a, const mx::Stream& s) {
  if (a.ndim() != 4 || a.shape(3) <= 1 || a.strides()[3] == 1) {
    return a;
  }
  mx::array c(a.shape(), a.dtype(), nullptr, {});
  c.set_data(mx::allocator::malloc(c.nbytes()));
  copy4d(a, c, s);
  mx::metal::get_command_encoder(s).add_temporary(c);
  return c;
}

} // namespace mlxq::metal_host
