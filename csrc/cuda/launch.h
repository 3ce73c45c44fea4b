// Host-side helpers for launching mlxq's CUDA kernels from eval_gpu.
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include "mlx/backend/cuda/device.h"

#include "cuda/kernel_args.h"
#include "sdpa_problem.h" // dtype_code

namespace mlxq::cuda {

namespace mx = mlx::core;

// Streaming multiprocessors of the current device (queried once).
int sm_count();

// The most dynamic shared memory a block may opt into on the current device
// (227 KB on an H100/H200, 99 KB on sm_86/89/120).
int max_smem_per_block();

// Allocates a kernel output or scratch from mlxq's stream-ordered device
// pool on the encoder's stream, held until the evaluation completes (see
// device_memory.cpp for why not MLX's allocator). Such buffers are not
// donatable.
void allocate(mx::array& a, mx::cu::CommandEncoder& enc);

// Allocates from MLX's allocator: for ring writes' copies, which a cache (or
// MLX's donation) later updates in place.
void allocate_cached(mx::array& a);

// One array per (slot, device, stream), kept across evaluations, for
// buffers a stream's kernels reuse (the decode merge's tickets, the GEMM
// family's scratch): `make` builds it when there is none or `fits` refuses
// the kept one. Registered with the encoder as a temporary, so a replaced
// array outlives the kernels of this evaluation that use it. Callers
// register every kernel that touches it as writing it, so MLX orders those
// kernels one after another within a graph; graphs of one stream run in
// order.
enum class StreamSlot : int { MergeCounters = 0, GemmScratch = 1 };
mx::array stream_array(
    mx::cu::CommandEncoder& enc,
    StreamSlot slot,
    const std::function<bool(const mx::array&)>& fits,
    const std::function<mx::array()>& make);

// Fills a fresh output with NaN (floats) or 0xFF bytes when the test hook
// asks for poisoned outputs (see debug.h).
void poison(mx::array& a, mx::cu::CommandEncoder& enc);

// Copies the strides of a 4-D array into dst[4].
void copy_strides(const mx::array& a, int64_t* dst);

// DequantizeInto's kernel over codes, scales and biases [B, H, N, *]
// (strided) into a row-contiguous [B, H, N, D] at `out` in `out_dtype`: the
// handle, arguments and grid, for `launch` with the caller's dependencies.
struct DequantLaunch {
  void* kernel;
  DequantArgs args;
  dim3 grid;
  dim3 block;
};
DequantLaunch dequantize_launch(
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    void* out,
    int out_dtype,
    int D,
    int group_size,
    int bits);

// RecentAttention's kernel (recent_attention.cpp): attention of q over a
// window's keys and values merged with out_q / lse_q (attention over other
// keys) into `out`, allocated by the caller.
void launch_recent(
    mx::cu::CommandEncoder& enc,
    const mx::array& q,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& out_q,
    const mx::array& lse_q,
    const mx::array& out,
    float scale,
    bool causal);

// Launches a kernel handle from kernel_args.h with one by-value argument.
// The encoder orders graph nodes by the arrays registered just before each
// node: `reads` become dependencies (list an array that an earlier kernel of
// this evaluation wrote, such as a poisoned or copied output, or a partial
// buffer), `writes` make later readers wait for this kernel.
template <typename Args>
void launch(
    mx::cu::CommandEncoder& enc,
    void* kernel,
    dim3 grid,
    dim3 block,
    uint32_t smem,
    Args& args,
    std::initializer_list<const mx::array*> reads,
    std::initializer_list<const mx::array*> writes) {
  for (const auto* a : reads) {
    enc.set_input_array(*a);
  }
  for (const auto* a : writes) {
    enc.set_output_array(*a);
  }
  enc.add_kernel_node_ex(static_cast<CUfunction>(kernel), grid, block, dim3{}, smem, args);
}

// The same, for a primitive's whole input and output lists.
template <typename Args>
void launch(
    mx::cu::CommandEncoder& enc,
    void* kernel,
    dim3 grid,
    dim3 block,
    uint32_t smem,
    Args& args,
    const std::vector<mx::array>& reads,
    const std::vector<mx::array>& writes) {
  for (const auto& a : reads) {
    enc.set_input_array(a);
  }
  for (const auto& a : writes) {
    enc.set_output_array(a);
  }
  enc.add_kernel_node_ex(static_cast<CUfunction>(kernel), grid, block, dim3{}, smem, args);
}

} // namespace mlxq::cuda
