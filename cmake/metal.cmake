# Metal backend (macOS): the metallib and the Metal host code. See issue 5.
message(FATAL_ERROR "mlxq: the Metal backend is not implemented yet")
