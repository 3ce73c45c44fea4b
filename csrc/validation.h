// Helpers for the op functions' input checks: every failure is a
// std::invalid_argument (ValueError in Python) that names the input, the
// expected property and what was received.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "mlx/array.h"

namespace mlxq {

std::string shape_str(const mlx::core::Shape& shape);
std::string dtype_str(mlx::core::Dtype dtype);
bool is_float_dtype(mlx::core::Dtype dtype);

// Message pieces, formatted without iostreams: the CUDA wheel's process
// crashed inside std::ostream's number formatting in this module.
inline std::string to_text(const std::string& s) {
  return s;
}
inline std::string to_text(const char* s) {
  return s;
}
std::string to_text(double v);
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string to_text(T v) {
  return std::to_string(v);
}

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts);

// A (packed, scales, biases) triple of 4-D arrays: uint32 codes, scales and
// biases of one float dtype and shape, agreeing on their first three axes
// [B, H, <rows>] (`rows` names the third axis in messages: "S" for a ring
// buffer, "N" for keys). `what` prefixes the messages, e.g. "keys ".
void check_triple_arrays(
    const char* op,
    const char* what,
    const char* rows,
    const mlx::core::array& packed,
    const mlx::core::array& scales,
    const mlx::core::array& biases);

// A mask array: bool or a float dtype (additive), broadcastable to `target`,
// whose axes `target_name` spells in messages, e.g. "[B, H_q, L, N]".
void check_mask_array(
    const char* op,
    const mlx::core::array& mask,
    const mlx::core::Shape& target,
    const char* target_name);

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::string msg = std::string("[") + op + "] ";
  ((msg += to_text(parts)), ...);
  throw std::invalid_argument(msg);
}

} // namespace mlxq
