"""quantized_sdpa's log-sum-exp output and merge_attention: attention over
two disjoint key sets merges exactly into attention over their union."""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import assert_close, random_inputs, random_sinks, to_f64
from support.reference64 import sdpa64

import mlxq
from mlxq.attention import merge_attention, recent_attention
from mlxq.guard import parts


def assert_lse_close(lse, ref, dtype):
    lse = to_f64(lse)
    assert lse.dtype == np.float64 and lse.shape == ref.shape
    dead = np.isinf(ref)
    assert np.array_equal(np.isinf(lse), dead) and np.all(lse[dead] < 0)
    # An absolute error on a log is a relative error on the denominator: the
    # kernel's f32 sums (and bf16/f16 queries' rounded scores) bound it.
    tol = {mx.float32: 1e-4, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    assert np.max(np.abs(lse[~dead] - ref[~dead]), initial=0.0) < tol


CASES = [
    # bits, v_bits, group, B, Hq, Hkv, L, N, D, q dtype, mask, sinks
    (4, 4, 64, 1, 8, 2, 1, 300, 128, mx.float32, None, False),
    (8, 4, 64, 2, 4, 1, 3, 5000, 64, mx.bfloat16, "causal", True),  # split keys
    (3, 3, 32, 1, 6, 3, 17, 77, 64, mx.float16, "causal", False),
    (2, 2, 128, 1, 4, 4, 5, 129, 128, mx.float32, "array", True),
    (6, 5, 32, 1, 2, 1, 40, 1000, 32, mx.float32, "array", False),
    (4, 4, 64, 1, 8, 1, 64, 4200, 256, mx.bfloat16, "causal", True),  # CUDA: the GEMM family
]


@pytest.mark.parametrize("bits,v_bits,gs,B,Hq,Hkv,L,N,D,q_dtype,mask,sinks", CASES)
def test_lse_matches_float64(rng, bits, v_bits, gs, B, Hq, Hkv, L, N, D, q_dtype, mask, sinks):
    q, k, v = random_inputs(
        rng,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        Dk=D,
        bits=bits,
        group_size=gs,
        v_bits=v_bits,
        q_dtype=q_dtype,
    )
    if mask == "array":  # some rows see nothing at all
        vis = rng.random((B, 1, L, N)) < 0.5
        vis[:, :, 0, :] = False
        mask = mx.array(vis)
    s = random_sinks(rng, Hq) if sinks else None
    scale = D**-0.5
    mlxq._ext._take_last_sdpa_kernel()
    out, lse = mlxq.quantized_sdpa(
        q, k, v, scale=scale, mask=mask, sinks=s, v_bits=v_bits, return_lse=True
    )
    mx.eval(out, lse)
    kernel = mlxq._ext._take_last_sdpa_kernel()
    if D == 256 and mx.default_device() == mx.gpu and mlxq.routing.gpu_backend() == "cuda":
        assert kernel == "cuda_gemm"  # its finish writes the log-sum-exp
    assert lse.dtype == mx.float32 and lse.shape == (B, Hq, L)
    ref, ref_lse = sdpa64(
        q,
        k,
        v,
        scale=scale,
        mask=mask,
        sinks=s,
        group_size=gs,
        bits=bits,
        v_bits=v_bits,
        return_lse=True,
    )
    assert_close(out, ref, dtype=q_dtype)
    assert_lse_close(lse, ref_lse, q_dtype)
    # The output is the plain kernel's, bit for bit.
    plain = mlxq.quantized_sdpa(q, k, v, scale=scale, mask=mask, sinks=s, v_bits=v_bits)
    assert mx.array_equal(out, plain).item()


@pytest.mark.parametrize("rotate", [False, True])
def test_two_segments_merge_into_the_whole(rng, rotate):
    """Keys [0, n) quantized through the kernel and keys [n, N) attended
    densely merge into the attention over all N keys (the reference)."""
    B, Hq, Hkv, L, N, D, n = 1, 8, 2, 6, 200, 64, 150
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float32))
    sinks = random_sinks(rng, Hq)
    scale = D**-0.5
    kq = mx.quantize(k[:, :, :n], group_size=64, bits=4)
    vq = mx.quantize(v[:, :, :n], group_size=64, bits=4)
    if rotate:
        from mlxq.hadamard import quantize
        from mlxq.hadamard import transform as hrot

        kq = quantize(k[:, :, :n], group_size=64, bits=4)
        vq = quantize(v[:, :, :n], group_size=64, bits=4)
    out_q, lse_q = mlxq.quantized_sdpa(q, kq, vq, scale=scale, sinks=sinks, return_lse=True)
    out_d, lse_d = mlxq.attention.dense_attention_with_lse(
        q, k[:, :, n:], v[:, :, n:], scale=scale, mask="causal"
    )
    out, lse = merge_attention(out_q, lse_q, out_d, lse_d)
    # Reference: the dequantized first n keys (rotated back) and the exact rest.
    kd = mx.dequantize(*parts(kq), group_size=64, bits=4)
    vd = mx.dequantize(*parts(vq), group_size=64, bits=4)
    if rotate:
        kd, vd = hrot(kd), hrot(vd)
    K = np.concatenate([to_f64(kd), to_f64(k[:, :, n:])], axis=2)
    V = np.concatenate([to_f64(vd), to_f64(v[:, :, n:])], axis=2)
    vis = np.ones((L, N), bool)
    vis[:, n:] = np.arange(N - n)[None, :] <= np.arange(L)[:, None] + (N - n) - L
    q64 = to_f64(q)
    ref = np.zeros((B, Hq, L, D))
    ref_lse = np.zeros((B, Hq, L))
    for h in range(Hq):
        s = scale * q64[0, h] @ K[0, h // 4].T
        s = np.where(vis, s, -np.inf)
        sk = float(to_f64(sinks)[h])
        m = np.maximum(s.max(-1, keepdims=True), sk)
        p = np.exp(s - m)
        den = p.sum(-1, keepdims=True) + np.exp(sk - m)
        ref[0, h] = p @ V[0, h // 4] / den
        ref_lse[0, h] = (m + np.log(den))[:, 0]
    # The dense part's f32 matmuls: exact on the CPU, TF32-like on CUDA.
    tol = 1e-4 if mx.default_device() == mx.cpu else 5e-3
    assert np.max(np.abs(to_f64(out) - ref)) < tol
    assert np.max(np.abs(to_f64(lse) - ref_lse)) < tol


def test_merge_weighs_an_empty_side_zero():
    a = mx.ones((1, 1, 2, 4))
    b = mx.full((1, 1, 2, 4), 3.0)
    inf = float("inf")
    out, lse = merge_attention(a, mx.array([[[0.5, -inf]]]), b, mx.array([[[-inf, -inf]]]))
    assert np.allclose(np.array(out[0, 0, 0]), 1.0) and np.allclose(np.array(out[0, 0, 1]), 0.0)
    assert np.isclose(lse[0, 0, 0].item(), 0.5) and lse[0, 0, 1].item() == -inf


def test_recent_attention_on_metal_is_refused(rng):
    # mlxq.sdpa attends a recent window with MLX ops there instead.
    if not mx.metal.is_available():
        pytest.skip("not a Metal build of MLX")
    q = mx.zeros((1, 2, 1, 64))
    k = mx.zeros((1, 1, 4, 64))
    with pytest.raises(ValueError, match="not yet on Metal"):
        recent_attention(q, k, k, q, mx.zeros((1, 2, 1)), scale=0.1, stream=mx.gpu)


@pytest.mark.parametrize("mask", ["causal", "array"])
def test_dense_attention_blocks_by_score_bytes(rng, monkeypatch, mask):
    """dense_attention_with_lse takes as many query rows per block as its
    f32 scores' budget allows (at least DENSE_ROW_BLOCK): one block or many,
    the same rows, each against float64."""
    B, Hq, Hkv, L, N, D = 1, 4, 2, 40, 56, 32
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hkv, N, D)).astype(np.float32))
    vis = np.arange(N)[None, :] <= np.arange(L)[:, None] + (N - L)
    if mask == "array":
        vis = vis & (rng.random((L, N)) < 0.7)
        vis[:, 0] = True
    m = "causal" if mask == "causal" else mx.array(vis)
    assert mlxq.attention._dense_rows(B, Hq, N) >= L  # the whole step in one block
    whole = mlxq.attention.dense_attention_with_lse(q, k, v, scale=0.2, mask=m)
    monkeypatch.setattr(mlxq.attention, "DENSE_SCORE_BYTES", 1)
    monkeypatch.setattr(mlxq.attention, "DENSE_ROW_BLOCK", 7)
    assert mlxq.attention._dense_rows(B, Hq, N) == 7
    blocked = mlxq.attention.dense_attention_with_lse(q, k, v, scale=0.2, mask=m)
    q64, k64, v64 = to_f64(q), to_f64(k), to_f64(v)
    # f32 matmuls: exact on the CPU, TF32-like on CUDA.
    tol = 1e-4 if mx.default_device() == mx.cpu else 5e-3
    for out, lse in (whole, blocked):
        for h in range(Hq):
            s = np.where(vis, 0.2 * q64[0, h] @ k64[0, h // 2].T, -np.inf)
            ref_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
            ref = np.exp(s - ref_lse[:, None]) @ v64[0, h // 2]
            assert np.max(np.abs(to_f64(out)[0, h] - ref)) < tol
            assert np.max(np.abs(to_f64(lse)[0, h] - ref_lse)) < tol
