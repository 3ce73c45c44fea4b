"""Helpers shared by the mlxq tests: random quantized inputs and error checks."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxq

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}

# The project's numerics contract (its design card's "Numerics", kept
# outside this tree): bound on ||out - ref|| / ||ref|| by query dtype.
TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


def to_f64(x: mx.array) -> np.ndarray:
    """An MLX float array as float64 NumPy (every float dtype fits f32 exactly)."""
    return np.array(x.astype(mx.float32)).astype(np.float64)


def quantize(x, group_size: int, bits: int, dtype=None):
    """``mx.quantize`` of ``x`` (NumPy or MLX; cast to ``dtype`` first when
    given, which sets the scales' dtype), evaluated, as a tuple."""
    x = mx.array(x) if isinstance(x, np.ndarray) else x
    triple = mx.quantize(x if dtype is None else x.astype(dtype), group_size=group_size, bits=bits)
    mx.eval(*triple)
    return tuple(triple)


def random_inputs(
    rng,
    *,
    B=1,
    Hq=8,
    Hkv=2,
    L=1,
    N=64,
    Dk=128,
    Dv=None,
    bits=4,
    group_size=64,
    q_dtype=mx.float32,
    kv_dtype=mx.float32,
    v_bits=None,
    v_group_size=None,
):
    """Random queries and quantized K/V triples of the given shapes (values
    quantized with ``v_bits`` / ``v_group_size`` when given, else as keys)."""
    Dv = Dk if Dv is None else Dv
    v_bits = bits if v_bits is None else v_bits
    v_group_size = group_size if v_group_size is None else v_group_size
    q = mx.array(rng.standard_normal((B, Hq, L, Dk), dtype=np.float32)).astype(q_dtype)
    mx.eval(q)
    k = quantize(rng.standard_normal((B, Hkv, N, Dk), dtype=np.float32), group_size, bits, kv_dtype)
    v = quantize(
        rng.standard_normal((B, Hkv, N, Dv), dtype=np.float32), v_group_size, v_bits, kv_dtype
    )
    return q, k, v


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def assert_close(out: mx.array, ref: np.ndarray, dtype=None, tol=None) -> float:
    """Checks ``out`` against a float64 reference with the tolerance TOL above.

    Rows that the reference sets to exactly zero are rows with no visible key;
    the kernel must give exactly 0 there too. Returns the relative error.
    """
    mx.eval(out)
    if dtype is not None:
        assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert tuple(out.shape) == ref.shape, f"output shape {out.shape}, expected {ref.shape}"
    got = to_f64(out)
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{bad.sum()} non-finite outputs, first at {np.argwhere(bad)[0]}"
    dead = ~ref.any(axis=-1)
    assert (got[dead] == 0).all(), "a row with no visible key is not exactly 0"
    if dead.all():
        return 0.0
    err = rel_err(got, ref)
    tol = TOL[out.dtype] if tol is None else tol
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    return err


def assert_cuda_kernel(expected):
    """On a CUDA GPU, that the last evaluated sdpa reached the kernel family
    ``expected`` ("cuda_decode", "cuda_tiled", "cuda_tiled_dense": the tiled
    kernel over a dense copy of K/V, "cuda_gemm": GEMMs over blocks of keys
    of that copy, "cuda_generic"), so a routing
    change cannot quietly move a case to a fallback. Clears the record; a
    no-op elsewhere, for ``expected=None``, and while a test run turns the
    tensor-core kernels off for a comparison."""
    used = mlxq._ext._take_last_sdpa_kernel()
    env = mlxq._ext._environment()
    if env["MLXQ_CUDA_DECODE"] == "0" or env["MLXQ_CUDA_TILED"] == "0":
        return
    if expected and mx.default_device() == mx.gpu and mx.cuda.is_available():
        assert used == expected, f"reached {used!r}, not {expected!r}"


def on_cuda_gpu() -> bool:
    """Whether the test runs on MLX's CUDA backend (the "gpu" device parameter
    with a CUDA build)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def skip_without_window_kernel():
    """Skips where mlxq.attention.recent_attention has no kernel (Metal, for
    now: mlxq.sdpa attends a recent window there with MLX ops)."""
    if mx.default_device() != mx.cpu and mx.metal.is_available():
        pytest.skip("recent_attention runs on the CPU and CUDA, not yet on Metal")


def random_sinks(rng, Hq, dtype=mx.float32):
    # Around the scale of the scores, so the sink takes a visible share.
    return mx.array(rng.normal(0.5, 1.5, Hq).astype(np.float32)).astype(dtype)


def backend_name() -> str:
    """The backend that runs the default device, for skip reasons."""
    if mx.default_device() == mx.cpu:
        return "CPU"
    if mx.cuda.is_available():
        return "CUDA"
    if mx.metal.is_available():
        return "Metal"
    return "GPU"


def stock_or_skip(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a stock baseline (mlx-lm's quantized attention
    composition, mlxq.reference's copy of it, mlx-lm's own ``kv_bits`` path),
    evaluated; the test is skipped where the baseline itself cannot run on
    this device: MLX's CUDA ``quantized_matmul`` raises "No implementation for
    problem shape" for many of the shapes these compositions produce. Any
    other error propagates. Returns ``fn``'s result."""
    try:
        out = fn(*args, **kwargs)
        mx.eval([x for _, x in tree_flatten(out) if isinstance(x, mx.array)])
    except RuntimeError as e:
        if "No implementation" not in str(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        pytest.skip(
            f"MLX's {backend_name()} quantized_matmul has no kernel for this shape: {first}"
        )
    return out


def exact_or_skip(baseline: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``baseline`` (a stock composition's float32 result, as float64), skipping
    the comparison with it on a CUDA GPU where it is itself further than the
    float32 bound from the float64 oracle ``ref``: MLX's CUDA f32 matmuls round
    like TF32 there, so it is no exact baseline to hold mlxq to. Elsewhere it
    is returned unchecked (and an inexact baseline fails the comparison)."""
    if on_cuda_gpu():
        err = rel_err(baseline, ref)
        if err > TOL[mx.float32]:
            pytest.skip(
                f"MLX's CUDA quantized_matmul composition is {err:.2g} from float64 "
                f"in f32 (> {TOL[mx.float32]:g}; its f32 matmuls round like TF32): "
                "no exact baseline here"
            )
    return baseline


def skip_mx_fast_oracle_on_cuda():
    """Skips a check of MLX's own ``mx.fast.scaled_dot_product_attention``
    against the float64 oracle on a CUDA GPU, where MLX's kernel is not held to
    TOL's f32 bound (its f32 matmuls round like TF32, and its masks and
    sinks handling differs). mlxq's own kernels are checked against the
    oracle on every device regardless."""
    if on_cuda_gpu():
        pytest.skip(
            "MLX's CUDA mx.fast.scaled_dot_product_attention is not float32-exact "
            "(TF32-like f32 matmuls; masks/sinks differ): it is not held to the "
            "oracle's f32 bound here"
        )
