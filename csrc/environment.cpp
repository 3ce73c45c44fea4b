#include "environment.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

namespace mlxq {

namespace {

struct Switch {
  const char* name;
  bool Environment::* field;
};

constexpr Switch kSwitches[] = {
    {"MLXQ_CUDA_DECODE", &Environment::cuda_decode},
    {"MLXQ_CUDA_TILED", &Environment::cuda_tiled},
    {"MLXQ_CUDA_TILED_DENSE", &Environment::cuda_tiled_dense},
    {"MLXQ_CUDA_FUSED_MERGE", &Environment::cuda_fused_merge},
    {"MLXQ_CUDA_GEMM", &Environment::cuda_gemm},
    {"MLXQ_CUDA_FUSED_RECENT", &Environment::cuda_fused_recent},
    {"MLXQ_CUDA_POOL", &Environment::cuda_pool},
    {"MLXQ_DEQUANTIZED_PREFILL", &Environment::dequantized_prefill},
    {"MLXQ_PREFILL_WORKSPACE", &Environment::prefill_workspace},
};

// Applies one variable's value; false if `name` is not one of ours.
bool apply(Environment& e, const std::string& name, const std::string& value) {
  for (const auto& s : kSwitches) {
    if (name == s.name) {
      e.*s.field = value != "0";
      return true;
    }
  }
  if (name == "MLXQ_NUM_THREADS") {
    e.num_threads = std::max(0, std::atoi(value.c_str()));
    return true;
  }
  if (name == "MLXQ_CPU_INT") {
    e.cpu_int = value == "1" ? "" : value;
    return true;
  }
  return false;
}

// Every variable apply() parses.
std::vector<const char*> names() {
  std::vector<const char*> out = {"MLXQ_NUM_THREADS", "MLXQ_CPU_INT"};
  for (const auto& s : kSwitches) {
    out.push_back(s.name);
  }
  return out;
}

Environment& mutable_environment() {
  static Environment e = [] {
    Environment e;
    for (const char* name : names()) {
      if (const char* v = std::getenv(name)) {
        apply(e, name, v);
      }
    }
    return e;
  }();
  return e;
}

struct TuningField {
  const char* name;
  int64_t Tuning::* field;
};

constexpr TuningField kTuningFields[] = {
    {"cuda_tiled_warps", &Tuning::cuda_tiled_warps},
    {"cuda_tiled_keys", &Tuning::cuda_tiled_keys},
    {"cuda_gemm_min_keys", &Tuning::cuda_gemm_min_keys},
    {"cuda_gemm_block_elements", &Tuning::cuda_gemm_block_elements},
    {"split_tasks_per_thread", &Tuning::split_tasks_per_thread},
};

Tuning& mutable_tuning() {
  static Tuning t;
  return t;
}

} // namespace

const Environment& environment() {
  return mutable_environment();
}

std::vector<std::pair<std::string, std::string>> environment_items() {
  const Environment& e = environment();
  std::vector<std::pair<std::string, std::string>> items = {
      {"MLXQ_NUM_THREADS", std::to_string(e.num_threads)},
      {"MLXQ_CPU_INT", e.cpu_int},
  };
  for (const auto& s : kSwitches) {
    items.emplace_back(s.name, e.*s.field ? "1" : "0");
  }
  return items;
}

void set_environment(const std::string& name, const std::string& value) {
  if (!apply(mutable_environment(), name, value)) {
    throw std::invalid_argument("[mlxq] " + name + " is not an mlxq environment variable");
  }
}

const Tuning& tuning() {
  return mutable_tuning();
}

void set_tuning(const std::string& name, int64_t value) {
  for (const auto& f : kTuningFields) {
    if (name == f.name) {
      mutable_tuning().*f.field = value;
      return;
    }
  }
  std::string known;
  for (const auto& f : kTuningFields) {
    known += std::string(known.empty() ? "" : ", ") + f.name;
  }
  throw std::invalid_argument("[mlxq] unknown tuning field " + name + " (known: " + known + ")");
}

} // namespace mlxq
