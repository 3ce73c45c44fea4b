"""Where many-row attention over quantized K/V runs on a GPU.

Prefill (many query rows against a long cache) is compute-bound, and MLX's
fused attention on bf16 K/V (cuDNN on CUDA, MLX's own full-attention kernel
on Metal) is several times faster there than mlxq's tiled kernel over packed
K/V. So on a GPU, when MLX really runs a fused kernel for the problem, mlxq
dequantizes the layer's K and V (a transient ``O(N * D)`` copy of one layer,
never the ``O(L * N)`` score matrix) and calls
``mx.fast.scaled_dot_product_attention``. Everything else keeps mlxq's
kernels, so memory stays bounded everywhere: decode (few rows, where reading
4x fewer bytes wins), the CPU (where mlxq's kernel is ~50x faster than
``mx.fast``), mask arrays (mlxq gives fully masked rows zeros, ``mx.fast``
does not), and any shape MLX would run through its unfused fallback, which
materialises the scores.

Head dims MLX has no fused kernel for on CUDA (256 and 512: Gemma's) are
not routed: mlxq's own CUDA primitive runs their prefill as cuBLAS GEMMs
over blocks of keys of a dense K/V copy inside one primitive (the GEMM
family, csrc/cuda/gemm_sdpa.cpp), which beats MLX's unfused fallback.

:func:`fused_attention_supported` restates MLX 0.32's own conditions for its
fused kernels (``has_fused_kernel`` / ``supports_sdpa_cudnn`` in MLX's CUDA
and Metal backends) so the decision can be tested on any machine; the call
itself passes ``force_fused=True``, so that should MLX disagree, it raises
and mlxq's kernel runs instead.
"""

from collections import Counter
from typing import Dict, Optional

import mlx.core as mx

from . import _ext

# Fewer query rows than this (per KV head) stay on mlxq's kernels: the
# decode kernel covers up to 8 rows and the dequantized copy costs O(N)
# whatever L is. docs/results/performance.md has the H200's timings of both
# routes at few rows (bench/kernels/gpu.py --only prefill).
MIN_ROUTED_QUERY_ROWS = 16

# MLX 0.32's fused attention, as its backends decide (see the module docstring).
CUDA_MAX_HEAD_DIM = 128  # cuDNN SDPA: head dims multiple of 8, at most 128
METAL_FULL_HEAD_DIMS = (64, 80, 128)  # MLX's Metal full-attention kernel (L > 8)
FUSED_DTYPES = (mx.float16, mx.bfloat16)

# MLXQ_DEQUANTIZED_PREFILL=0 keeps every call on mlxq's kernels. With
# MLXQ_PREFILL_WORKSPACE, the dense K/V go into one reused buffer per stream
# (mlxq.workspace) instead of a fresh mx.dequantize per layer; 0 for
# comparisons. Both are read by mlxq's one environment reader.
_enabled = _ext._environment()["MLXQ_DEQUANTIZED_PREFILL"] == "1"
_workspace = _ext._environment()["MLXQ_PREFILL_WORKSPACE"] == "1"
_routes: Counter = Counter()


def note_route(name: str) -> None:
    _routes[name] += 1


def take_route_counts() -> Dict[str, int]:
    """Test hook: quantized attention calls routed to ``mx.fast`` since the last call."""
    counts = dict(_routes)
    _routes.clear()
    return counts


def set_dequantized_prefill(enabled: bool) -> bool:
    """Turn the dequantize-then-``mx.fast`` route on or off; returns the old setting.

    Off, every quantized attention runs on mlxq's kernels (benchmarks and the
    kernel tests use this). Also settable with ``MLXQ_DEQUANTIZED_PREFILL=0``.
    """
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    return old


def set_prefill_workspace(enabled: bool) -> bool:
    """Dequantize routed layers into one reused buffer per stream (default) or
    with ``mx.dequantize`` per layer; returns the old setting."""
    global _workspace
    old, _workspace = _workspace, bool(enabled)
    return old


def workspace_enabled() -> bool:
    return _workspace


def gpu_backend() -> Optional[str]:
    """``"cuda"``, ``"metal"`` or None: the GPU backend this MLX build has."""
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


def fused_attention_supported(
    backend: Optional[str], *, L: int, N: int, Dk: int, Dv: int, dtype, mask_kind: str
) -> bool:
    """Whether MLX 0.32 runs ``mx.fast.scaled_dot_product_attention`` fused here.

    ``backend`` is ``"cuda"``, ``"metal"`` or None (CPU); ``mask_kind`` is
    ``"none"``, ``"causal"`` or ``"array"``. Only L > 8 is considered (the
    vector kernels for few rows are not used by this route).
    """
    if dtype not in FUSED_DTYPES or L <= 8:
        return False
    if mask_kind == "causal" and L > N:  # neither backend aligns causal with L > N
        return False
    if backend == "cuda":
        return Dk % 8 == 0 and Dv % 8 == 0 and Dk <= CUDA_MAX_HEAD_DIM and Dv <= CUDA_MAX_HEAD_DIM
    if backend == "metal":
        return Dk == Dv and Dk in METAL_FULL_HEAD_DIMS
    return False


def route_through_mx_fast(
    backend: Optional[str],
    *,
    L: int,
    N: int,
    Hq: int,
    Hkv: int,
    Dk: int,
    Dv: int,
    dtype,
    scales_dtype,
    mask_kind: str,
    sinks_dtype=None,
) -> bool:
    """The decision: dequantize and use MLX's fused attention, or keep mlxq's kernel.

    Routed only on a GPU, for at least :data:`MIN_ROUTED_QUERY_ROWS` query rows
    per KV head, with no mask or ``"causal"`` (whose rows always see a key
    when L <= N, so both agree on every row), when the dequantized K/V come
    out in the query's dtype, sinks (if any, ``sinks_dtype``) are in that
    dtype too (MLX 0.32.4's CUDA kernel refuses sinks that do not promote to
    the output type, e.g. f32 sinks with bf16 queries), and MLX has a fused
    kernel for the shape.
    """
    if not _enabled or backend is None or dtype not in FUSED_DTYPES or scales_dtype != dtype:
        return False
    if mask_kind not in ("none", "causal") or (mask_kind == "causal" and L > N):
        return False
    if sinks_dtype is not None and sinks_dtype != dtype:
        return False
    if L * (Hq // max(Hkv, 1)) < MIN_ROUTED_QUERY_ROWS:
        return False
    return fused_attention_supported(
        backend, L=L, N=N, Dk=Dk, Dv=Dv, dtype=dtype, mask_kind=mask_kind
    )
