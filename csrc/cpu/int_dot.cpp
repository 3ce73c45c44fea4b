// Run-time choice of the integer kernels (int_dot.h): the AVX-512 and AVX2
// ones are compiled for their instruction sets by target attributes
// (MQ_INT_FN), whatever the build machine, and used only where the CPU
// reports them.
#include "cpu/int_dot.h"

#include <string>

#include "environment.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MQ_INT_X86 1
#define MQ_INT_FN __attribute__((target(MQ_INT_TARGET))) inline
#define MQ_INT_VBMI_FN __attribute__((target(MQ_INT_TARGET ",avx512vbmi"))) inline

// AVX2 first: the AVX-512 kernels call its byte spreading on CPUs without VBMI.
#define MQ_INT_TARGET "avx2,fma,f16c"
#include "cpu/int_dot_avx2.inc"
#undef MQ_INT_TARGET

#define MQ_INT_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma"
#define MQ_INT_NS avx512_vnni
#define MQ_INT_VNNI 1
#define MQ_INT_NAME "avx512-vnni"
#include "cpu/int_dot_avx512.inc"
#undef MQ_INT_TARGET
#undef MQ_INT_NS
#undef MQ_INT_VNNI
#undef MQ_INT_NAME

#define MQ_INT_TARGET "avx512f,avx512bw,avx512dq,avx512vl,fma"
#define MQ_INT_NS avx512_bw
#define MQ_INT_VNNI 0
#define MQ_INT_NAME "avx512-bw"
#include "cpu/int_dot_avx512.inc"
#undef MQ_INT_TARGET
#endif

namespace mlxq::cpu {

const IntDot* int_dot() {
  // Read per call: tests and benchmarks switch paths in one process
  // (set_environment).
  const std::string& choice = environment().cpu_int;
  if (choice == "0") {
    return nullptr;
  }
#if defined(MQ_INT_X86)
  static const bool has_avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c");
  }();
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  static const IntDot* best = []() -> const IntDot* {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      if (__builtin_cpu_supports("avx512vnni")) {
        return vbmi ? &avx512_vnni::kernels_vbmi : &avx512_vnni::kernels;
      }
      return vbmi ? &avx512_bw::kernels_vbmi : &avx512_bw::kernels;
    }
    return has_avx2 ? &avx2::kernels : nullptr;
  }();
  if (choice == "avx2") {
    return has_avx2 ? &avx2::kernels : nullptr;
  }
  if (choice == "avx512-bw" && best && std::strcmp(best->name, "avx512-vnni") == 0) {
    // the VNNI CPU runs the BW kernels too (tests)
    return vbmi ? &avx512_bw::kernels_vbmi : &avx512_bw::kernels;
  }
  return best;
#else
  return nullptr;
#endif
}

} // namespace mlxq::cpu
