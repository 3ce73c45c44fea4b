// Reading a test hook's arguments from a Python dict (the `_metal_plan_*`
// and `_cuda_plan_sdpa` bindings): a key's value, or a default when absent.
#pragma once

#include <nanobind/nanobind.h>

namespace mlxq::dict_args {

template <typename T>
T get(const nanobind::dict& d, const char* key, T fallback) {
  return d.contains(key) ? nanobind::cast<T>(d[key]) : fallback;
}

} // namespace mlxq::dict_args
