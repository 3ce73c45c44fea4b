// Our C++ errors as Python exceptions, for every binding of mlxq._ext.
#pragma once

#include <stdexcept>
#include <utility>

#include <nanobind/nanobind.h>

namespace mlxq::bindings {

namespace nb = nanobind;

// Turns our C++ errors into Python exceptions right here. nanobind hands any
// other exception to the translators of the whole "mlx" domain, mlx.core's
// included; when mlx.core was built against another C++ runtime (the CUDA
// wheel), rethrowing our exception object inside its translator crashes the
// process instead of raising.
template <typename Fn>
decltype(auto) translate_errors(Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    throw nb::value_error(e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    throw nb::python_error();
  }
}

template <typename R, typename... Args>
auto guarded(R (*f)(Args...)) {
  return [f](Args... args) -> R {
    return translate_errors([&]() -> R { return f(std::forward<Args>(args)...); });
  };
}

} // namespace mlxq::bindings
