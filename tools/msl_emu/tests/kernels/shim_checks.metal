// Checks of the emulator pieces that mlxq's kernels lean on: rounding modes,
// conversions, sub-word threadgroup reads, 16-byte loads, 64-bit shifts,
// SIMD votes and reductions with infinities, and a function constant that
// directly follows an #include (mslpp once glued it onto the line marker).
#include <metal_stdlib>
#include "defines.h"
constant bool fc_after_include [[function_constant(30)]];

using namespace metal;

kernel void shim_rounding(
    device const float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    device uchar* codes [[buffer(2)]],
    device half* h [[buffer(3)]],
    uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  out[4 * i + 0] = round(v); // half away from zero
  out[4 * i + 1] = rint(v);  // half to even
  out[4 * i + 2] = fma(v, 3.0f, 1.0f);
  out[4 * i + 3] = max(v, -INFINITY);
  codes[i] = uchar(min(round(abs(v)), 255.0f));
  h[i] = half(v);
}

kernel void shim_tg_bytes(
    device const uint4* in [[buffer(0)]],
    device uint* out [[buffer(1)]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint words[128 + 1];
  const uint4 v = in[lane];
  words[4 * lane + 0] = v.x;
  words[4 * lane + 1] = v.y;
  words[4 * lane + 2] = v.z;
  words[4 * lane + 3] = v.w;
  if (lane == 0) {
    words[128] = 0;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = ((const threadgroup uchar*)words)[(lane * 5) % 512];
  const ulong pair = (ulong(words[4 * lane + 1]) << 32) | words[4 * lane];
  out[32 + lane] = uint((pair >> lane) & 0xffffffffu);
}

kernel void shim_simd(
    device const float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[lane];
  out[0 * 32 + lane] = simd_any(v > 0.5f) ? 1.0f : 0.0f;
  out[1 * 32 + lane] = simd_min(v);
  out[2 * 32 + lane] = simd_max(v);
  out[3 * 32 + lane] = simd_shuffle(v, ushort(lane ^ 3));
  out[4 * 32 + lane] = simd_sum(v);
  out[5 * 32 + lane] = fc_after_include ? 1.0f : 0.0f;
}
