#include "validation.h"

#include <cstdio>
#include <utility>

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
  switch (dtype) {
    case mx::bool_:
      return "bool";
    case mx::uint8:
      return "uint8";
    case mx::uint16:
      return "uint16";
    case mx::uint32:
      return "uint32";
    case mx::uint64:
      return "uint64";
    case mx::int8:
      return "int8";
    case mx::int16:
      return "int16";
    case mx::int32:
      return "int32";
    case mx::int64:
      return "int64";
    case mx::float16:
      return "float16";
    case mx::bfloat16:
      return "bfloat16";
    case mx::float32:
      return "float32";
    case mx::float64:
      return "float64";
    case mx::complex64:
      return "complex64";
  }
  return "unknown";
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

} // namespace mlxq
