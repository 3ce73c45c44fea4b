// Helpers for the op functions' input checks: every failure is a
// std::invalid_argument (ValueError in Python) that names the input, the
// expected property and what was received.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/array.h"

namespace mlxq {

std::string shape_str(const mlx::core::Shape& shape);
std::string dtype_str(mlx::core::Dtype dtype);
bool is_float_dtype(mlx::core::Dtype dtype);

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream msg;
  msg << "[" << op << "] ";
  (msg << ... << parts);
  throw std::invalid_argument(msg.str());
}

} // namespace mlxq
