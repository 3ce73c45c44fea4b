// Where many-row attention over quantized K/V runs on a GPU.
//
// Prefill (many query rows against a long cache) is compute-bound, and MLX's
// fused attention on bf16 K/V (cuDNN on CUDA, MLX's own full-attention kernel
// on Metal) is several times faster there than mlxq's tiled kernel over
// packed K/V. So on a GPU, when MLX really runs a fused kernel for the
// problem, quantized_sdpa dequantizes the layer's K and V into this stream's
// workspace (prefill_workspace.h: a transient O(N * D) copy of one layer,
// never the O(L * N) scores) and composes fast::scaled_dot_product_attention.
// Everything else keeps the QuantizedSDPA primitive, so memory stays bounded
// everywhere: decode (few rows, where reading 4x fewer bytes wins), the CPU
// (where mlxq's kernel is ~50x faster than mx.fast), mask arrays (mlxq gives
// fully masked rows zeros, mx.fast does not), and any shape MLX would run
// through its unfused fallback, which materialises the scores.
//
// Head dims MLX has no fused kernel for on CUDA (256 and 512: Gemma's) are
// not routed: mlxq's CUDA primitive runs their prefill as cuBLAS GEMMs over
// blocks of keys (csrc/cuda/gemm_sdpa.cpp), which beats MLX's unfused
// fallback.
//
// MLX does not export its own ScaledDotProductAttention::use_fallback, so
// mlx_has_fused_attention restates MLX 0.32's conditions (has_fused_kernel /
// supports_sdpa_cudnn in its CUDA and Metal backends) for each backend; the
// composed call passes force_fused, so that should MLX disagree it raises
// and the primitive runs instead.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "mlx/ops.h"

#include "sdpa_codes.h"

namespace mlxq {

namespace mx = mlx::core;

enum class GpuBackend { None, Cuda, Metal };

// The GPU backend this build of mlxq runs: each backend's sources define it
// (csrc/cuda/, csrc/metal/; csrc/no_gpu.cpp: None).
GpuBackend gpu_backend();

// Fewer query rows than this (per KV head) stay on mlxq's kernels: the decode
// kernel covers up to 8 rows and the dequantized copy costs O(N) whatever L
// is. docs/results/performance.md has the H200's timings of both routes at
// few rows (bench/kernels/gpu.py --only prefill).
constexpr int kMinRoutedQueryRows = 16;

struct PrefillProblem {
  int L, N, Hq, Hkv, Dk, Dv;
  mx::Dtype dtype; // the queries'
  mx::Dtype scales_dtype; // the dequantized K/V come out in it
  MaskCode mask;
  std::optional<mx::Dtype> sinks_dtype;
};

// Whether MLX 0.32 runs fast::scaled_dot_product_attention fused for the
// problem on `backend` (only L > 8 is considered: the vector kernels for few
// rows are not used by this route).
bool mlx_has_fused_attention(GpuBackend backend, const PrefillProblem& p);

// The decision: dequantize and compose MLX's fused attention, or keep the
// primitive. Routed only on a GPU, when MLXQ_DEQUANTIZED_PREFILL is on, for
// at least kMinRoutedQueryRows rows per KV head, with no mask or "causal"
// (whose rows always see a key when L <= N, so both agree on every row),
// when the dequantized K/V come out in the query's dtype and sinks (if any)
// are in it too (MLX 0.32.4's CUDA kernel refuses sinks that do not promote
// to the output type), and MLX has a fused kernel for the shape.
bool route_to_mx_fast(GpuBackend backend, const PrefillProblem& p);

// Exact rows attended after the first `n` quantized rows of the buffers (a
// recent window's step: the window, then the step's own rows). The dense
// K/V are the buffers' rows [0, n) dequantized with these rows after them;
// buffers holding at least n + T rows are dequantized whole into the
// workspace and the exact rows written over rows [n, n + T) (whatever the
// buffers hold there is never read).
struct ExactRows {
  mx::array keys, values; // [B, H_kv, T, D], the queries' dtype
  int n;
};

// The routed attention, or nullopt where the primitive must run (not routed,
// or MLX refused the fused kernel). Inputs are validated by the caller; with
// `exact`, `p.N` counts its rows too.
std::optional<mx::array> routed_prefill(
    const mx::array& q,
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const PrefillProblem& p,
    float scale,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    const std::optional<mx::array>& sinks,
    mx::Stream s,
    const std::optional<ExactRows>& exact = std::nullopt);

// routed_prefill's attention without the decision, on any stream: MLX's
// attention over the dequantized K/V (and `exact`), or nullopt where
// `force_fused` is set and MLX has no fused kernel. The CPU tests call it
// with force_fused off (MLX's CPU attention is never fused).
std::optional<mx::array> dequantized_attention(
    const mx::array& q,
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const PrefillProblem& p,
    float scale,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    const std::optional<mx::array>& sinks,
    const std::optional<ExactRows>& exact,
    bool force_fused,
    mx::Stream s);

// Test hook: calls routed to mx.fast by route name since the last call (then
// resets).
std::map<std::string, int> take_route_counts();

} // namespace mlxq
