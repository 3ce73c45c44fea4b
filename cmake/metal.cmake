# Metal backend (macOS, MLX built with Metal): mlxq.metallib from metal/*.metal
# and the eval_gpu host code in csrc/metal/. Included by CMakeLists.txt when
# MLX_BUILD_METAL; the no-GPU stub (csrc/no_gpu.cpp) is not part of this build.

file(GLOB MQ_METAL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal)
file(GLOB MQ_METAL_HEADERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.h)

# The oldest macOS the metallib is marked for. Without one (and without
# CMAKE_OSX_DEPLOYMENT_TARGET) `xcrun metal` marks it for the SDK's own OS,
# and older systems then refuse to load it ("language version ... not
# supported on this OS"). Default: what MLX 0.32 itself requires (macOS 14,
# MSL 3.1); override with -DMLXQ_METAL_DEPLOYMENT_TARGET=...
if(CMAKE_OSX_DEPLOYMENT_TARGET)
  set(_mlxq_metal_target_default ${CMAKE_OSX_DEPLOYMENT_TARGET})
else()
  set(_mlxq_metal_target_default 14.0)
endif()
set(MLXQ_METAL_DEPLOYMENT_TARGET ${_mlxq_metal_target_default}
    CACHE STRING "macOS deployment target of mlxq.metallib")

# MLX's helper (share/cmake/MLX/extension.cmake): one .air per source with
# `xcrun metal -fno-fast-math ...` (the flags MLX builds its own kernels
# with), linked into ${CMAKE_CURRENT_BINARY_DIR}/mlxq.metallib.
# -DMLXQ_METAL_WERROR=ON (the macOS CI job): Metal compiler warnings fail
# the build.
option(MLXQ_METAL_WERROR "Treat Metal compiler warnings as errors" OFF)
set(_mlxq_metal_options)
if(MLXQ_METAL_WERROR)
  list(APPEND _mlxq_metal_options -Werror)
endif()

mlx_build_metallib(
  TARGET mlxq_metallib
  TITLE mlxq
  DEPLOYMENT_TARGET ${MLXQ_METAL_DEPLOYMENT_TARGET}
  COMPILE_OPTIONS ${_mlxq_metal_options}
  SOURCES ${MQ_METAL_SOURCES}
  INCLUDE_DIRS ${CMAKE_CURRENT_SOURCE_DIR}/metal ${MLX_INCLUDE_DIRS}
  DEPS ${MQ_METAL_HEADERS}
  OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})

target_sources(mlxq_core PRIVATE
  csrc/metal/kernels.cpp
  csrc/metal/quantized_sdpa.cpp
  csrc/metal/ring_update.cpp
  csrc/metal/recent_attention.cpp
  csrc/metal/dequantize_into.cpp)
target_include_directories(mlxq_core PRIVATE ${MLX_INCLUDE_DIRS})
add_dependencies(mlxq_core mlxq_metallib)

# The host code loads mlxq.metallib from the directory of mlxq/_ext*.so.
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlxq.metallib DESTINATION .)
