// The element-type and mask codes every backend's attention uses: the op
// (QuantizedSDPAParams), the CPU task plan, CUDA's SdpaArgs and kernels, and
// Metal's MlxqSdpaParams (whose MQ_DT_* macros, shared with the .metal
// sources, are checked against these in csrc/metal/). Plain enums with no
// MLX dependency, so nvcc compiles this header too.
#pragma once

namespace mlxq {

// Element types as the kernels read them (queries, outputs, scales, masks).
enum DtypeCode : int { kF32 = 0, kF16 = 1, kBF16 = 2, kBool = 3 };

// What masks the scores: nothing, "causal" (position l sees keys
// <= l + N - L), or a bool / additive array broadcast to [B, Hq, L, N].
enum MaskCode : int { kMaskNone = 0, kMaskCausal = 1, kMaskArray = 2 };

} // namespace mlxq
