"""quantized_sdpa with recent_keys / recent_values: quantized keys and an
exact window of recent rows attended in one op (on CUDA the decode kernel's
extra blocks, folded in by its split merge; elsewhere the quantized part
with its log-sum-exp, then RecentAttention), against float64 over the union
of both key sets."""

from typing import NamedTuple, Optional

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import (
    DTYPES,
    assert_close,
    assert_cuda_kernel,
    quantize,
    random_sinks,
    skip_without_window_kernel,
    to_f64,
)
from support.reference64 import dequantize64, mask64

from mlxq import _ext


class Case(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    L: int
    N: int
    T: int
    D: int
    bits: int
    group_size: int
    causal: bool = False
    mask: Optional[str] = None  # None, "bool" or "additive" over the quantized keys
    sinks: bool = False
    v_bits: Optional[int] = None
    decode: bool = True  # f16/bf16 queries reach the decode kernel on CUDA


CASES = {
    # A SmolLM2-shaped decode step and its 129-row window (three recent blocks).
    "smollm2": Case(1, 9, 3, 1, 700, 129, 64, 4, 64),
    "gqa-bool-sinks": Case(2, 8, 2, 1, 300, 64, 128, 4, 64, mask="bool", sinks=True),
    "draft-causal": Case(1, 2, 1, 3, 100, 70, 128, 4, 32, causal=True),
    "8bit-additive": Case(1, 8, 2, 1, 513, 200, 128, 8, 64, mask="additive", sinks=True),
    # 16 query heads on one KV head: two head groups of 8 rows.
    "head-groups": Case(1, 16, 1, 1, 256, 65, 512, 4, 64, mask="additive"),
    "d256-causal-sinks": Case(1, 8, 4, 2, 90, 5, 256, 4, 64, causal=True, sinks=True),
    "k8v4": Case(1, 4, 2, 1, 200, 128, 128, 8, 64, v_bits=4),
    "long-window": Case(2, 4, 4, 1, 40, 300, 64, 4, 32),
    # One window row, one quantized row: blocks with almost nothing to read.
    "one-row-each": Case(1, 8, 2, 1, 1, 1, 128, 4, 64, sinks=True),
    # 12 rows over 3 positions: no decode instance takes it.
    "many-rows": Case(1, 4, 1, 3, 100, 70, 128, 4, 64, causal=True, decode=False),
}


def union64(q, kq, vq, ke, ve, c: Case, mask, sinks, scale):
    """Float64 attention over [dequantized rows, window rows]: the mask over
    the first, causal (query l sees window row j <= l + T - L) or nothing
    over the second, sinks in the denominator."""
    vb = c.bits if c.v_bits is None else c.v_bits
    K = np.concatenate([dequantize64(kq, c.group_size, c.bits), to_f64(ke)], axis=2)
    V = np.concatenate([dequantize64(vq, c.group_size, vb), to_f64(ve)], axis=2)
    rep = c.Hq // c.Hkv
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    vis_q, add_q = mask64(mask, (c.B, c.Hq, c.L, c.N))
    vis_e = np.ones((c.B, c.Hq, c.L, c.T), bool)
    if c.causal:
        vis_e &= np.arange(c.T)[None, :] <= np.arange(c.L)[:, None] + c.T - c.L
    visible = np.concatenate([vis_q, vis_e], axis=-1)
    additive = np.concatenate([add_q, np.zeros(vis_e.shape)], axis=-1)
    s = scale * to_f64(q) @ np.swapaxes(K, -1, -2) + additive
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, to_f64(sinks)[None, :, None, None])
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(to_f64(sinks)[None, :, None, None] - m)
    return (p / denom) @ V


def inputs(rng, c: Case, dt):
    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    q = rand(c.B, c.Hq, c.L, c.D)
    vb = c.bits if c.v_bits is None else c.v_bits
    kq = quantize(
        rng.standard_normal((c.B, c.Hkv, c.N, c.D)).astype(np.float32), c.group_size, c.bits, dt
    )
    vq = quantize(
        rng.standard_normal((c.B, c.Hkv, c.N, c.D)).astype(np.float32), c.group_size, vb, dt
    )
    ke, ve = rand(c.B, c.Hkv, c.T, c.D), rand(c.B, c.Hkv, c.T, c.D)
    mask = None
    if c.mask == "bool":
        mask = mx.array(rng.random((c.B, 1, c.L, c.N)) < 0.8)
    elif c.mask == "additive":
        mask = rand(c.B, c.Hq, c.L, c.N)
    sinks = random_sinks(rng, c.Hq) if c.sinks else None
    return q, kq, vq, ke, ve, mask, sinks


def attend(q, kq, vq, ke, ve, c: Case, mask, sinks, scale):
    return _ext.quantized_sdpa(
        q,
        *kq,
        *vq,
        scale=scale,
        mask=mask,
        sinks=sinks,
        bits=c.bits,
        group_size=c.group_size,
        v_bits=c.v_bits,
        recent_keys=ke,
        recent_values=ve,
        recent_causal=c.causal,
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_over_the_union(rng, dtype, name):
    skip_without_window_kernel()
    c, dt = CASES[name], DTYPES[dtype]
    q, kq, vq, ke, ve, mask, sinks = inputs(rng, c, dt)
    scale = c.D**-0.5
    out = attend(q, kq, vq, ke, ve, c, mask, sinks, scale)
    assert_close(out, union64(q, kq, vq, ke, ve, c, mask, sinks, scale), dtype=dt)
    assert_cuda_kernel("cuda_decode" if c.decode and dtype != "f32" else "cuda_recent")


@pytest.mark.parametrize("name", ["smollm2", "gqa-bool-sinks", "draft-causal", "head-groups"])
def test_the_two_step_route_agrees(rng, set_env, name):
    # MLXQ_CUDA_FUSED_RECENT=0: the quantized part with its log-sum-exp, then
    # RecentAttention's kernel (what a non-decode plan does), on the same
    # inputs as the fused blocks.
    skip_without_window_kernel()
    c = CASES[name]
    q, kq, vq, ke, ve, mask, sinks = inputs(rng, c, mx.bfloat16)
    scale = c.D**-0.5
    ref = union64(q, kq, vq, ke, ve, c, mask, sinks, scale)
    fused = attend(q, kq, vq, ke, ve, c, mask, sinks, scale)
    assert_close(fused, ref, dtype=mx.bfloat16)
    assert_cuda_kernel("cuda_decode")
    set_env("MLXQ_CUDA_FUSED_RECENT", "0")
    apart = attend(q, kq, vq, ke, ve, c, mask, sinks, scale)
    assert_close(apart, ref, dtype=mx.bfloat16)
    assert_cuda_kernel("cuda_recent")


def test_strided_views(rng):
    # q as attention layers hand it ([B, L, H, D] transposed), the window as
    # strided slices of larger buffers (no 16-byte row loads).
    skip_without_window_kernel()
    c = Case(1, 4, 2, 2, 50, 33, 64, 4, 64, causal=True)
    q = mx.array(rng.standard_normal((1, 2, 4, 64)).astype(np.float32)).astype(mx.bfloat16)
    q = q.swapaxes(1, 2)
    big = mx.array(rng.standard_normal((1, 2, 66, 72)).astype(np.float32)).astype(mx.bfloat16)
    ke, ve = big[:, :, ::2, :64], big[:, :, 1::2, 8:]
    kq = quantize(rng.standard_normal((1, 2, 50, 64)).astype(np.float32), 64, 4, mx.bfloat16)
    vq = quantize(rng.standard_normal((1, 2, 50, 64)).astype(np.float32), 64, 4, mx.bfloat16)
    out = attend(q, kq, vq, ke, ve, c, None, None, 0.125)
    assert_close(out, union64(q, kq, vq, ke, ve, c, None, None, 0.125), dtype=mx.bfloat16)
    assert_cuda_kernel("cuda_decode")


def _with_junk_rows(rng, t, c: Case, bits: int, extra: int):
    """``t`` grown by ``extra`` rows of large random codes, as a cache's
    buffer holds rows past those a step attends."""
    junk = quantize(
        50 * rng.standard_normal((c.B, c.Hkv, extra, c.D)).astype(np.float32),
        c.group_size,
        bits,
        t[1].dtype,
    )
    return tuple(mx.concatenate([a, j], axis=2) for a, j in zip(t, junk))


@pytest.mark.parametrize("name", ["smollm2", "gqa-bool-sinks", "k8v4", "draft-causal", "many-rows"])
def test_rows_of_whole_buffers(rng, name):
    # rows=N over buffers of N + 37 rows (a cache's whole buffers, the
    # decode step's fetch): rows [0, N) only, with the window against
    # float64, without it bit for bit the call over the N rows themselves.
    c = CASES[name]
    q, kq, vq, ke, ve, mask, sinks = inputs(rng, c, mx.bfloat16)
    vb = c.bits if c.v_bits is None else c.v_bits
    kw, vw = _with_junk_rows(rng, kq, c, c.bits, 37), _with_junk_rows(rng, vq, c, vb, 37)
    scale = c.D**-0.5
    formats = dict(bits=c.bits, group_size=c.group_size, v_bits=c.v_bits)
    plain = dict(scale=scale, mask=mask, sinks=sinks, **formats)
    whole = _ext.quantized_sdpa(q, *kw, *vw, rows=c.N, **plain)
    cut = _ext.quantized_sdpa(q, *kq, *vq, **plain)
    assert np.array_equal(np.array(whole.astype(mx.float32)), np.array(cut.astype(mx.float32)))
    skip_without_window_kernel()
    window = dict(recent_keys=ke, recent_values=ve, recent_causal=c.causal)
    out = _ext.quantized_sdpa(q, *kw, *vw, rows=c.N, **plain, **window)
    assert_close(out, union64(q, kq, vq, ke, ve, c, mask, sinks, scale), dtype=mx.bfloat16)


def test_rows_of_a_prefill_sized_step(rng):
    # More than 8 query rows: the op cuts the buffers before any routing.
    c = Case(1, 4, 2, 24, 90, 0, 64, 4, 64)
    q, kq, vq, _, _, _, _ = inputs(rng, c, mx.bfloat16)
    kw, vw = _with_junk_rows(rng, kq, c, 4, 11), _with_junk_rows(rng, vq, c, 4, 11)
    whole = _ext.quantized_sdpa(q, *kw, *vw, scale=0.125, mask_mode="causal", rows=c.N)
    cut = _ext.quantized_sdpa(q, *kq, *vq, scale=0.125, mask_mode="causal")
    assert np.array_equal(np.array(whole.astype(mx.float32)), np.array(cut.astype(mx.float32)))


def test_rows_outside_the_buffers_are_refused(rng):
    c = CASES["smollm2"]
    q, kq, vq, _, _, _, _ = inputs(rng, c, mx.bfloat16)
    for rows in (-1, c.N + 1):
        with pytest.raises(ValueError, match=r"rows must lie in \[0, 700\]"):
            _ext.quantized_sdpa(q, *kq, *vq, scale=1.0, rows=rows)


def test_bad_recent_rows_are_refused(rng):
    c = CASES["smollm2"]
    q, kq, vq, ke, ve, _, _ = inputs(rng, c, mx.bfloat16)

    def call(**kw):
        args = dict(scale=1.0, recent_keys=ke, recent_values=ve)
        args.update(kw)
        return _ext.quantized_sdpa(q, *kq, *vq, **args)

    with pytest.raises(ValueError, match="recent_keys and recent_values together"):
        call(recent_values=None)
    with pytest.raises(ValueError, match="return_lse is not available with recent rows"):
        call(return_lse=True)
    with pytest.raises(ValueError, match="recent_keys and recent_values must have q's dtype"):
        call(recent_keys=ke.astype(mx.float16))
    with pytest.raises(ValueError, match="quantized rows' 3 KV heads"):
        call(recent_keys=ke[:, :1], recent_values=ve[:, :1])
    with pytest.raises(ValueError, match="do not fit q"):
        call(recent_keys=ke[..., :32])
    with pytest.raises(ValueError, match="causal window must hold"):
        q3 = mx.zeros((1, 9, 3, 64), mx.bfloat16)
        _ext.quantized_sdpa(
            q3,
            *kq,
            *vq,
            scale=1.0,
            recent_keys=ke[:, :, :2],
            recent_values=ve[:, :, :2],
            recent_causal=True,
        )
