// The MLXQ_* environment variables, read in one place: environment() parses
// them all at its first call. docs/environment.md lists each with its default.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mlxq {

// A switch is off when its variable is "0" and on otherwise (unset included).
struct Environment {
  int num_threads = 0; // MLXQ_NUM_THREADS; 0: one per hardware thread
  // MLXQ_CPU_INT: "" the best integer kernels, "0" the f32 products, or a
  // kernel set by name ("avx2", "avx512-bw") where the CPU runs it.
  std::string cpu_int;
  bool cuda_decode = true; // MLXQ_CUDA_DECODE
  bool cuda_tiled = true; // MLXQ_CUDA_TILED
  bool cuda_tiled_dense = true; // MLXQ_CUDA_TILED_DENSE
  bool cuda_fused_merge = true; // MLXQ_CUDA_FUSED_MERGE
  bool cuda_gemm = true; // MLXQ_CUDA_GEMM
  bool cuda_fused_recent = true; // MLXQ_CUDA_FUSED_RECENT
  bool cuda_pool = true; // MLXQ_CUDA_POOL
  bool dequantized_prefill = true; // MLXQ_DEQUANTIZED_PREFILL
  bool prefill_workspace = true; // MLXQ_PREFILL_WORKSPACE
};

const Environment& environment();

// Every variable environment() reads, with its value as parsed.
std::vector<std::pair<std::string, std::string>> environment_items();

// Test hook: parses `value` for variable `name` as if it had been set at
// start. Throws std::invalid_argument for a name environment() does not read.
void set_environment(const std::string& name, const std::string& value);

// Measured block shapes and thresholds of the plans. They are not settings:
// tests and benchmarks override them through set_tuning. 0 leaves the choice
// to the plan.
struct Tuning {
  int64_t cuda_tiled_warps = 0; // row warps of a tiled block
  int64_t cuda_tiled_keys = 32; // keys per tiled step
  int64_t cuda_gemm_min_keys = 0; // keys from which the GEMM prefill may run
  int64_t cuda_gemm_block_elements = 0; // score elements per GEMM key block
  int64_t split_tasks_per_thread = 4; // CPU: key-split tasks per pool thread
};

const Tuning& tuning();

// Test hook: sets one Tuning field by name (std::invalid_argument if unknown).
void set_tuning(const std::string& name, int64_t value);

} // namespace mlxq
