// Run-time choice of the integer kernels (int_dot.h): the AVX-512 ones are
// compiled for their instruction sets by target pragmas, whatever the build
// machine, and used only where the CPU reports them.
#include "cpu/int_dot.h"

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLXQ_INT_X86 1
#define MLXQ_INT_FN __attribute__((target(MLXQ_INT_TARGET))) inline

#define MLXQ_INT_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma"
#define MLXQ_INT_NS avx512_vnni
#define MLXQ_INT_VNNI 1
#define MLXQ_INT_NAME "avx512-vnni"
#include "cpu/int_dot_avx512.inc"
#undef MLXQ_INT_TARGET
#undef MLXQ_INT_NS
#undef MLXQ_INT_VNNI
#undef MLXQ_INT_NAME

#define MLXQ_INT_TARGET "avx512f,avx512bw,avx512dq,avx512vl,fma"
#define MLXQ_INT_NS avx512_bw
#define MLXQ_INT_VNNI 0
#define MLXQ_INT_NAME "avx512-bw"
#include "cpu/int_dot_avx512.inc"
#endif

namespace mlxq::cpu {

const IntDot* int_dot() {
  const char* env = std::getenv("MLXQ_CPU_INT"); // read per call: tests compare both paths
  if (env && env[0] == '0') {
    return nullptr;
  }
  static const IntDot* chosen = []() -> const IntDot* {
#if defined(MLXQ_INT_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      return __builtin_cpu_supports("avx512vnni") ? &avx512_vnni::kernels : &avx512_bw::kernels;
    }
#endif
    return nullptr;
  }();
  return chosen;
}

} // namespace mlxq::cpu
