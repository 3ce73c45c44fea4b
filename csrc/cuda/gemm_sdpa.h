// The GEMM family of CUDA attention (plan.h's Family::Gemm): many query rows
// over a dense K/V copy as cuBLAS GEMMs over blocks of keys, the blocks
// folded by an online softmax, all on this evaluation's own scratch.
#pragma once

#include <vector>

#include "cuda/sdpa/plan.h"
#include "mlx/backend/cuda/device.h"

namespace mlxq::cuda {

namespace mx = mlx::core;

// kd / vd: K and V dequantized, [B, Hkv, N, D] contiguous in the query's
// dtype, inside `dense` (which their copy nodes wrote).
void eval_gemm(
    mx::cu::CommandEncoder& enc,
    const SdpaProblem& p,
    const Plan& plan,
    const std::vector<mx::array>& in,
    const mx::array& dense,
    const void* kd,
    const void* vd,
    mx::array& out,
    mx::array* lse = nullptr);

} // namespace mlxq::cuda
