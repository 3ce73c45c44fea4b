# Metal backend (macOS, MLX built with Metal): mlxq.metallib from metal/*.metal
# and the eval_gpu host code in csrc/metal/. Included by CMakeLists.txt when
# MLX_BUILD_METAL; the no-GPU stub (csrc/no_gpu.cpp) is not part of this build.

file(GLOB MLXQ_METAL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.metal)
file(GLOB MLXQ_METAL_HEADERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/metal/*.h)

# MLX's helper (share/cmake/MLX/extension.cmake): one .air per source with
# `xcrun metal -fno-fast-math ...` (the flags MLX builds its own kernels
# with), linked into ${CMAKE_CURRENT_BINARY_DIR}/mlxq.metallib.
mlx_build_metallib(
  TARGET mlxq_metallib
  TITLE mlxq
  SOURCES ${MLXQ_METAL_SOURCES}
  INCLUDE_DIRS ${CMAKE_CURRENT_SOURCE_DIR}/metal ${MLX_INCLUDE_DIRS}
  DEPS ${MLXQ_METAL_HEADERS}
  OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})

target_sources(mlxq_core PRIVATE
  csrc/metal/kernels.cpp
  csrc/metal/quantized_sdpa.cpp
  csrc/metal/ring_update.cpp)
target_include_directories(mlxq_core PRIVATE ${MLX_INCLUDE_DIRS})
add_dependencies(mlxq_core mlxq_metallib)

# The host code loads mlxq.metallib from the directory of mlxq/_ext*.so.
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlxq.metallib DESTINATION .)
