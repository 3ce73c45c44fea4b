#include "validation.h"

#include <cstdio>
#include <sstream>
#include <utility>

#include "mlx/utils.h"

namespace mlxq {

namespace mx = mlx::core;

std::string shape_str(const mx::Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string to_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

std::string dtype_str(mx::Dtype dtype) {
  std::ostringstream s; // MLX's own names: "float32", "bfloat16", ...
  s << dtype;
  return s.str();
}

bool is_float_dtype(mx::Dtype dtype) {
  return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16;
}

void check_triple_arrays(
    const char* op,
    const char* what,
    const char* rows,
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases) {
  const std::pair<const mx::array*, const char*> parts[3] = {
      {&packed, "packed"}, {&scales, "scales"}, {&biases, "biases"}};
  for (const auto& [a, name] : parts) {
    if (a->ndim() != 4) {
      fail(
          op,
          what,
          name,
          " must be 4-D [B, H, ",
          rows,
          ", *], got shape ",
          shape_str(a->shape()),
          ".");
    }
  }
  if (packed.dtype() != mx::uint32) {
    fail(op, what, "packed must be uint32, got ", dtype_str(packed.dtype()), ".");
  }
  if (!is_float_dtype(scales.dtype()) || biases.dtype() != scales.dtype()) {
    fail(
        op,
        what,
        "scales and biases must share one float dtype, got ",
        dtype_str(scales.dtype()),
        " and ",
        dtype_str(biases.dtype()),
        ".");
  }
  if (scales.shape() != biases.shape()) {
    fail(
        op,
        what,
        "scales shape ",
        shape_str(scales.shape()),
        " does not match biases shape ",
        shape_str(biases.shape()),
        ".");
  }
  for (int d = 0; d < 3; ++d) {
    if (packed.shape(d) != scales.shape(d)) {
      fail(
          op,
          what,
          "packed shape ",
          shape_str(packed.shape()),
          " and scales shape ",
          shape_str(scales.shape()),
          " disagree on [B, H, ",
          rows,
          "].");
    }
  }
}

void check_mask_array(
    const char* op,
    const mx::array& mask,
    const mx::Shape& target,
    const char* target_name) {
  if (mask.dtype() != mx::bool_ && !is_float_dtype(mask.dtype())) {
    fail(
        op,
        "mask array must be bool or float32/float16/bfloat16, got ",
        dtype_str(mask.dtype()),
        ".");
  }
  const int n = static_cast<int>(target.size());
  bool ok = static_cast<int>(mask.ndim()) <= n;
  for (int i = 0; ok && i < static_cast<int>(mask.ndim()); ++i) {
    const int dm = mask.shape(mask.ndim() - 1 - i), dt = target[n - 1 - i];
    ok = dm == dt || dm == 1;
  }
  if (!ok) {
    fail(
        op,
        "mask shape ",
        shape_str(mask.shape()),
        " cannot be broadcast to ",
        target_name,
        " = ",
        shape_str(target),
        ".");
  }
}

} // namespace mlxq
