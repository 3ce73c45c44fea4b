"""Many-row attention on a GPU: dequantize one layer and use MLX's fused kernel.

The op's decision (csrc/prefill_route.h, asked through mlxq.routing) restates
MLX 0.32's own conditions for its fused attention for both backends, so it
is tested here on every machine; on a GPU the routed result
is checked against the float64 oracle like every kernel, and on the CPU
nothing is routed.
"""

import mlx.core as mx
import pytest
from support.helpers import assert_close, assert_cuda_kernel, random_inputs
from support.reference64 import sdpa64

import mlxq
from mlxq import routing

BF16, F16, F32 = mx.bfloat16, mx.float16, mx.float32


def problem(
    L=2048, N=4096, Hq=32, Hkv=8, Dk=128, Dv=None, dtype=BF16, scales_dtype=None, mask_kind="causal"
):
    """The keyword arguments of a routing decision (Dv and scales default to Dk and dtype)."""
    return dict(
        L=L,
        N=N,
        Hq=Hq,
        Hkv=Hkv,
        Dk=Dk,
        Dv=Dk if Dv is None else Dv,
        dtype=dtype,
        scales_dtype=dtype if scales_dtype is None else scales_dtype,
        mask_kind=mask_kind,
    )


def route(backend, sinks_dtype=None, **kw):
    return routing.route_through_mx_fast(backend, sinks_dtype=sinks_dtype, **problem(**kw))


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_prefill_routes_where_mlx_has_a_fused_kernel(backend):
    assert route(backend)
    assert route(backend, mask_kind="none")
    assert route(backend, dtype=F16)
    assert route(backend, Dk=64)
    assert route(backend, L=16, Hq=8, Hkv=8)  # 16 rows per KV head


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_everything_else_keeps_mlxq(backend):
    assert not route(None)  # the CPU: mlxq's kernel is ~50x faster than mx.fast there
    assert not route(backend, L=1)  # decode reads 4x fewer bytes on mlxq's kernel
    assert not route(backend, L=8, Hq=8, Hkv=8)  # the vector kernels' range
    assert not route(backend, L=12, Hq=8, Hkv=8)  # fewer than 16 rows per KV head
    assert not route(backend, mask_kind="array")  # fully masked rows: zeros only on mlxq
    assert not route(backend, dtype=F32)
    assert not route(backend, scales_dtype=F32)  # dequantized K/V would not match q
    assert not route(backend, Dk=512)  # MLX falls back to its unfused composition
    assert not route(backend, L=4096, N=2048)  # causal with L > N: no fused kernel
    assert route(backend, L=4096, N=2048, mask_kind="none")
    assert not route(backend, sinks_dtype=F32)  # f32 sinks do not promote to bf16
    assert route(backend, sinks_dtype=BF16)


def test_backend_specific_head_dims():
    # cuDNN takes head dims up to 128 (multiples of 8), Dk != Dv included;
    # MLX's Metal full-attention kernel {64, 80, 128} with Dk == Dv.
    assert route("cuda", Dk=96) and route("cuda", Dk=128, Dv=64)
    assert not route("cuda", Dk=256) and not route("cuda", Dk=100)
    assert route("metal", Dk=80)
    assert not route("metal", Dk=96) and not route("metal", Dk=128, Dv=64)
    assert not route("metal", Dk=256)


def test_switch_turns_the_route_off():
    old = routing.set_dequantized_prefill(False)
    try:
        assert not route("cuda")
    finally:
        routing.set_dequantized_prefill(old)
    assert route("cuda") == old


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize(
    "L,N,sinks_dtype", [(64, 200, None), (130, 130, None), (40, 1000, "q"), (40, 1000, "f32")]
)
def test_many_rows_match_the_oracle(rng, device, dtype, mask, L, N, sinks_dtype):
    q, k, v = random_inputs(
        rng, Hq=8, Hkv=2, L=L, N=N, Dk=128, bits=4, group_size=64, q_dtype=dtype, kv_dtype=dtype
    )
    sinks = None
    if sinks_dtype is not None:
        sinks = mx.array(rng.standard_normal(8).astype("float32"))
        sinks = sinks.astype(dtype) if sinks_dtype == "q" else sinks
    routing.take_route_counts()
    out = mlxq.sdpa(q, k, v, scale=128**-0.5, mask=mask, sinks=sinks)
    mx.eval(out)
    routed = routing.take_route_counts().get("mx_fast", 0)
    # f32 sinks with half-precision queries stay on mlxq (MLX refuses them).
    expected = routing.gpu_backend() is not None and device == mx.gpu and sinks_dtype != "f32"
    assert routed == int(expected), f"routed {routed} calls on {device}"
    ref = sdpa64(q, k, v, scale=128**-0.5, mask=mask, sinks=sinks, group_size=64, bits=4)
    assert out.dtype == dtype and out.shape == (1, 8, L, 128)
    assert_close(out, ref, dtype)


def test_routed_inputs_are_still_validated(rng):
    q, k, v = random_inputs(rng, L=64, N=128, q_dtype=BF16, kv_dtype=BF16)
    with pytest.raises(ValueError, match="bits"):
        mlxq.sdpa(q, k, v, scale=1.0, mask="causal", bits=7)
    with pytest.raises(ValueError):
        mlxq.sdpa(q, k, (v[0][..., :8], v[1], v[2]), scale=1.0, mask="causal")


@pytest.mark.parametrize("mask", [None, "causal"])
def test_wide_prefill_stays_on_mlxq_and_matches_the_oracle(rng, device, mask):
    # Gemma 4's global-layer shape: MLX has no fused kernel for head dim 512,
    # so nothing is routed; on CUDA mlxq's primitive runs it as GEMMs over key
    # blocks (tests/ops/test_prefill.py checks that family in depth).
    q, k, v = random_inputs(
        rng, Hq=8, Hkv=1, L=64, N=4100, Dk=512, bits=4, group_size=64, q_dtype=BF16, kv_dtype=BF16
    )
    routing.take_route_counts()
    out = mlxq.sdpa(q, k, v, scale=512**-0.5, mask=mask)
    mx.eval(out)
    assert not routing.take_route_counts()
    ref = sdpa64(q, k, v, scale=512**-0.5, mask=mask, group_size=64, bits=4)
    assert_close(out, ref, BF16)
    assert_cuda_kernel("cuda_gemm")
