// Metal host helpers shared by mlxq's eval_gpu implementations: the metallib
// beside the extension, pipeline lookup, dispatch of a plan, strided copy.
// Compiled only in Metal builds of MLX (cmake/metal.cmake).
#pragma once

#ifndef _METAL_
#error "csrc/metal/*.cpp is compiled only against a Metal build of MLX"
#endif

#include <string>

#include "mlx/array.h"
#include "mlx/backend/metal/device.h"

#include "metal/dispatch.h"

namespace mlxq::metal_host {

namespace mx = mlx::core;
namespace md = mlxq::metal_dispatch;

// Pipeline of kernel `name` from mlxq.metallib (next to mlxq/_ext*.so);
// raises when it does not run 32-wide SIMD groups, which every kernel assumes.
MTL::ComputePipelineState* kernel(mx::metal::Device& d, const std::string& name);

// Whether the buffer under `a` starts at a 16-byte aligned address (the
// kernels' uint4 loads also need the array's offset and strides aligned).
bool base_aligned16(const mx::array& a);

// Encodes a dispatch of `grid` (threadgroups, or threads when
// `grid_is_threads`) with `group` threads per threadgroup. Empty grids are
// skipped.
void dispatch(
    mx::metal::CommandEncoder& enc,
    const md::Size3& grid,
    const md::Size3& group,
    bool grid_is_threads);

// MQ_DT_* of a float dtype.
int dtype_code(mx::Dtype t);

// Copies the 4-D array `src` (any strides) into the row-contiguous `dst` of
// the same shape and dtype, whose memory is allocated, with mlxq_copy4d.
void copy4d(const mx::array& src, mx::array& dst, const mx::Stream& s);

// `a` itself when its last axis is contiguous, else a row-contiguous copy
// registered as a temporary of the command encoder.
mx::array rows_contiguous(const mx::array& a, const mx::Stream& s);

} // namespace mlxq::metal_host
