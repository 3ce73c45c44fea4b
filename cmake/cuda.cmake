# CUDA backend (the mlx[cuda13] wheel: find_package(MLX) found the CUDA toolkit).
#
# The .cu kernels include no MLX headers (nvcc cannot parse them) and build as
# their own object library; the launch glue in csrc/cuda/*.cpp is compiled by
# the host compiler against MLX's CUDA headers. libmlx links the CUDA runtime
# statically, so our kernels are launched through driver CUfunction handles
# (cudaGetFuncBySymbol) with our own static runtime.
enable_language(CUDA)
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  # What MLX's CUDA wheel targets (Ampere through Blackwell, with PTX for newer).
  set(CMAKE_CUDA_ARCHITECTURES "80;90;100;120")
endif()

add_library(mlxq_cuda_kernels OBJECT
  csrc/cuda/sdpa/decode_4bit.cu
  csrc/cuda/sdpa/decode_8bit.cu
  csrc/cuda/sdpa/decode_k8v4.cu
  csrc/cuda/sdpa/tiled_bf16.cu
  csrc/cuda/sdpa/tiled_f16.cu
  csrc/cuda/sdpa/generic.cu
  csrc/cuda/sdpa/merge.cu
  csrc/cuda/sdpa/gemm.cu
  csrc/cuda/fill.cu
  csrc/cuda/dequantize.cu
  csrc/cuda/ring_update.cu
  csrc/cuda/recent_attention.cu)
set_target_properties(mlxq_cuda_kernels PROPERTIES
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON)
target_include_directories(mlxq_cuda_kernels PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
target_compile_options(mlxq_cuda_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3>)

target_sources(mlxq_core PRIVATE
  csrc/cuda/device_memory.cpp
  csrc/cuda/launch.cpp
  csrc/cuda/quantized_sdpa.cpp
  csrc/cuda/gemm_sdpa.cpp
  csrc/cuda/ring_update.cpp
  csrc/cuda/recent_attention.cpp
  csrc/cuda/dequantize_into.cpp
  $<TARGET_OBJECTS:mlxq_cuda_kernels>)
# mlx/backend/cuda/device.h includes <fmt/format.h>, which no wheel ships.
if(DEFINED ENV{MLXQ_FMT_INCLUDE})
  target_include_directories(mlxq_core PRIVATE $ENV{MLXQ_FMT_INCLUDE})
endif()
target_compile_definitions(mlxq_core PRIVATE FMT_HEADER_ONLY)
# cuBLASLt for the GEMM family (libmlx itself loads the same library).
target_link_libraries(mlxq_core PUBLIC CUDA::cudart_static CUDA::cuda_driver CUDA::cublasLt)
