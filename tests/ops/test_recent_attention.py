"""mlxq.attention.recent_attention: a decode step's exact window attended and
merged with the quantized part's output and log-sum-exp in one primitive,
against float64 over the union of both key sets."""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import DTYPES, assert_close, skip_without_window_kernel, to_f64

from mlxq.attention import recent_attention


def union64(q, kq, vq, ke, ve, scale, causal=False, mask=None):
    """Float64 attention of q over two key sets (the "quantized" one plain
    here: only its output and log-sum-exp reach the primitive); ``causal``:
    query l sees the window's rows j <= l + T - L; ``mask`` (numpy, bool or
    additive, broadcastable to [B, Hq, L, T]): the window's rows. A row that
    sees no key at all is zeros."""
    K = np.concatenate([to_f64(kq), to_f64(ke)], axis=2)
    V = np.concatenate([to_f64(vq), to_f64(ve)], axis=2)
    q64 = to_f64(q)
    rep = q.shape[1] // K.shape[1]
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    s = scale * q64 @ np.swapaxes(K, -1, -2)
    if causal:
        L, N, T = q.shape[2], kq.shape[2], ke.shape[2]
        j = np.arange(N + T)[None, :] - N
        s = np.where(j <= np.arange(L)[:, None] + T - L, s, -np.inf)
    if mask is not None:
        N = kq.shape[2]
        m = np.broadcast_to(mask, s.shape[:3] + (s.shape[3] - N,))
        m = np.where(m, 0.0, -np.inf) if m.dtype == bool else m.astype(np.float64)
        s = s + np.concatenate([np.zeros(s.shape[:3] + (N,)), m], axis=-1)
    seen = np.isfinite(s).any(-1, keepdims=True)
    p = np.exp(s - np.where(seen, s.max(-1, keepdims=True), 0.0))
    return np.where(seen, p / np.where(seen, p.sum(-1, keepdims=True), 1.0), 0.0) @ V


def part64(q, k, v, scale):
    """Output and log-sum-exp of q over one key set, as the kernel hands them."""
    q64, K, V = to_f64(q), to_f64(k), to_f64(v)
    rep = q.shape[1] // K.shape[1]
    K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
    s = scale * q64 @ np.swapaxes(K, -1, -2)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    return (p / p.sum(-1, keepdims=True)) @ V, lse


def attend(rng, dt, B, Hq, Hkv, L, N, T, Dk, Dv, causal=False, mask=None):
    """recent_attention over fresh random inputs of these shapes (``N``
    other keys given by their float64 output and log-sum-exp, ``T`` window
    rows), checked against float64 over the union."""

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    scale = Dk**-0.5
    q = rand(B, Hq, L, Dk)
    kq, vq = rand(B, Hkv, N, Dk), rand(B, Hkv, N, Dv)
    ke, ve = rand(B, Hkv, T, Dk), rand(B, Hkv, T, Dv)
    if N:  # (causal: the other keys all precede the queries)
        out_q, lse_q = part64(q, kq, vq, scale)
    else:  # the other part saw no key: output 0, log-sum-exp -inf
        out_q, lse_q = np.zeros((B, Hq, L, Dv)), np.full((B, Hq, L), -np.inf)
    out = recent_attention(
        q,
        ke,
        ve,
        mx.array(out_q.astype(np.float32)).astype(dt),
        mx.array(lse_q.astype(np.float32)),
        scale=scale,
        causal=causal,
        mask=mask,
    )
    # The reference reads the mask as the kernel does: its values in its dtype.
    m = (
        None
        if mask is None
        else np.array(mask if mask.dtype == mx.bool_ else mask.astype(mx.float32))
    )
    assert_close(out, union64(q, kq, vq, ke, ve, scale, causal, mask=m), dtype=dt)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,N,T,Dk,Dv,causal",
    [
        (1, 9, 3, 1, 200, 129, 64, 64, False),
        (2, 4, 1, 1, 37, 1, 256, 256, False),
        (1, 8, 8, 3, 10, 65, 128, 96, False),
        (1, 2, 1, 1, 5, 300, 512, 512, False),
        (1, 6, 2, 2, 0, 17, 80, 40, False),
        (1, 9, 3, 70, 40, 198, 64, 64, True),
        (2, 4, 2, 5, 0, 5, 128, 128, True),
        (1, 4, 1, 130, 3, 131, 256, 256, True),
    ],
)
def test_matches_float64_over_the_union(rng, dtype, B, Hq, Hkv, L, N, T, Dk, Dv, causal):
    skip_without_window_kernel()
    attend(rng, DTYPES[dtype], B, Hq, Hkv, L, N, T, Dk, Dv, causal=causal)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "B,Hq,Hkv,L,N,T,D,mask_kind,mask_shape",
    [
        # A sliding-window layer's first prompt chunk: nothing quantized, a
        # band mask over the chunk's own rows as mlx-lm builds it ([L, T]).
        (1, 4, 1, 70, 0, 70, 256, "band", "LT"),
        (2, 6, 2, 9, 0, 40, 64, "bool", "BHLT"),
        (1, 8, 4, 5, 33, 21, 128, "additive", "B1LT"),
        (1, 4, 2, 3, 12, 65, 80, "bool", "1HLT"),
        (1, 2, 1, 1, 50, 9, 512, "additive", "T"),
    ],
)
def test_mask_matches_float64(rng, dtype, B, Hq, Hkv, L, N, T, D, mask_kind, mask_shape):
    # The mask array runs in the CPU kernel on every machine: the inputs
    # are made on the CPU too, so no GPU stream feeds the CPU one.
    dt = DTYPES[dtype]
    dims = {"B": B, "H": Hq, "L": L, "T": T, "1": 1}
    shape = tuple(dims[c] for c in mask_shape)
    if mask_kind == "band":  # query l sees keys (l - 16, l]
        j, i = np.arange(T)[None, :], np.arange(L)[:, None] + T - L
        m = (j <= i) & (j > i - 16)
    else:
        m = rng.random(shape) < 0.6
        m.reshape(-1, shape[-1])[::3] = False  # rows hidden whole
    with mx.stream(mx.cpu):
        if mask_kind == "additive":
            mask = mx.array(np.where(m, rng.standard_normal(shape), -np.inf).astype(np.float32))
            mask = mask.astype(dt)
        else:
            mask = mx.array(m)
        attend(rng, dt, B, Hq, Hkv, L, N, T, D, D, mask=mask)


def test_mask_is_refused_where_no_kernel_takes_it():
    q, k = mx.zeros((1, 4, 2, 64)), mx.zeros((1, 2, 8, 64))
    o, lse = mx.zeros((1, 4, 2, 64)), mx.zeros((1, 4, 2))
    ok = mx.ones((2, 8), dtype=mx.bool_)
    with pytest.raises(ValueError, match="not both"):
        recent_attention(q, k, k, o, lse, scale=1.0, causal=True, mask=ok, stream=mx.cpu)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        recent_attention(q, k, k, o, lse, scale=1.0, mask=ok[:, :7], stream=mx.cpu)
    with pytest.raises(ValueError, match="must be bool or float"):
        recent_attention(q, k, k, o, lse, scale=1.0, mask=ok.astype(mx.int32), stream=mx.cpu)
    if mx.default_device() == mx.cpu:
        pytest.skip("no GPU stream here: the CPU checks above ran")
    with pytest.raises(ValueError, match="(CPU only|not yet on Metal)"):
        recent_attention(q, k, k, o, lse, scale=1.0, mask=ok, stream=mx.gpu)


def test_strided_views(rng):
    # q as attention layers hand it ([B, L, H, D] transposed), a ring's rows
    # as a slice of a larger buffer, out_q transposed too.
    skip_without_window_kernel()
    B, Hq, Hkv, L, T, D = 1, 4, 2, 2, 33, 64
    q = mx.array(rng.standard_normal((B, L, Hq, D)).astype(np.float32)).swapaxes(1, 2)
    big = mx.array(rng.standard_normal((B, Hkv, 2 * T, D + 8)).astype(np.float32))
    ke, ve = big[:, :, ::2, :D], big[:, :, 1::2, 8:]
    kq = mx.array(rng.standard_normal((B, Hkv, 20, D)).astype(np.float32))
    vq = mx.array(rng.standard_normal((B, Hkv, 20, D)).astype(np.float32))
    out_q, lse_q = part64(q, kq, vq, 0.125)
    oq = mx.array(out_q.astype(np.float32).swapaxes(1, 2)).swapaxes(1, 2)
    out = recent_attention(q, ke, ve, oq, mx.array(lse_q.astype(np.float32)), scale=0.125)
    assert_close(out, union64(q, kq, vq, ke, ve, 0.125), dtype=mx.float32)


def test_bad_inputs_are_refused():
    q = mx.zeros((1, 4, 1, 64))
    k = mx.zeros((1, 2, 8, 64))
    o, lse = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 4, 1))
    with pytest.raises(ValueError, match="q's dtype"):
        recent_attention(q, k.astype(mx.float16), k, o, lse, scale=1.0)
    with pytest.raises(ValueError, match="do not fit q"):
        recent_attention(q, k, k[:, :, :4], o, lse, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        recent_attention(q, mx.zeros((1, 3, 8, 64)), mx.zeros((1, 3, 8, 64)), o, lse, scale=1.0)
    with pytest.raises(ValueError, match="causal window must hold"):
        recent_attention(
            mx.zeros((1, 4, 9, 64)),
            k,
            k,
            mx.zeros((1, 4, 9, 64)),
            mx.zeros((1, 4, 9)),
            scale=1.0,
            causal=True,
        )
    with pytest.raises(ValueError, match="at least one key"):
        recent_attention(q, k[:, :, :0], k[:, :, :0], o, lse, scale=1.0)
    with pytest.raises(ValueError, match="out_q must be"):
        recent_attention(q, k, k, o[..., :32], lse, scale=1.0)
    with pytest.raises(ValueError, match="lse_q must be float32"):
        recent_attention(q, k, k, o, lse.astype(mx.float16), scale=1.0)
    with pytest.raises(ValueError, match="head dims"):
        big = mx.zeros((1, 2, 8, 640))
        recent_attention(
            mx.zeros((1, 4, 1, 640)), big, big, mx.zeros((1, 4, 1, 640)), lse, scale=1.0
        )
    with pytest.raises(ValueError, match="must be 4-D"):
        recent_attention(q[0], k, k, o, lse, scale=1.0)
