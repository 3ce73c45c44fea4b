// Test hooks. With output poisoning on, every primitive fills a freshly
// allocated output with a sentinel (NaN for floats, 0xFF bytes otherwise)
// before its kernel runs, so elements a kernel forgets to write fail tests
// instead of silently keeping whatever the allocator's cache held.
#pragma once

#include <cstdint>

#include "mlx/array.h"

namespace mlxq {

void set_poison_outputs(bool enabled);
bool poison_outputs();
void poison_if_enabled(mlx::core::array& out);

// Test hook: the kernel family the last QuantizedSDPA evaluation on CUDA
// chose ("cuda_decode", "cuda_tiled", "cuda_tiled_dense", "cuda_gemm" or
// "cuda_generic"). Routing depends on
// layouts and limits, so GPU tests pin which kernel their cases reach instead
// of silently testing a fallback. take_last_sdpa_kernel() returns it and
// clears it ("" when none ran since the last take).
void note_sdpa_kernel(const char* name);
const char* take_last_sdpa_kernel();

// mlxq's own GPU memory: on CUDA, kernel outputs and scratch come from
// mlxq's stream-ordered pool (cuda/device_memory.cpp), which MLX's
// get_active_memory/get_peak_memory do not see. Benchmarks add the peak to
// MLX's. take_device_bytes_peak() returns the peak since the last take and
// restarts it from what is in use now. Zero on the CPU and Metal.
void note_device_bytes(int64_t delta);
int64_t device_bytes_active();
int64_t take_device_bytes_peak();

// Prints a native backtrace to stderr on SIGSEGV/SIGABRT (for machines with
// no debugger), then lets the signal kill the process as before.
void install_crash_backtrace();

} // namespace mlxq
