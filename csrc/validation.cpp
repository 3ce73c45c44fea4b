#include "validation.h"

#include <cstdio>

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

} // namespace mlxq
