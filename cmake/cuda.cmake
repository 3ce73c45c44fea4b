# CUDA backend (mlx[cuda13]). See issue 6.
message(FATAL_ERROR "mlxq: the CUDA backend is not implemented yet")
