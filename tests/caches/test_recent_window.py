"""Quantized caches that keep their most recent tokens exact (``recent``,
mlxq.cache.recent): the window's bookkeeping through growth, trims, states
and copies, the two-part attention against float64, and mlx-lm's generation
with ``enable(kv_recent=...)``."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from support.caches import assert_same, kv
from support.helpers import assert_close, quantize, to_f64
from support.reference64 import dequantize64, hadamard64, mask64

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.guard import parts
from mlxq.random_models import random_model
from mlxq.split import RecentSplit


def tolerance():
    """The dense window's f32 matmuls: exact on the CPU, TF32-like on CUDA."""
    return 2e-5 if mx.default_device() == mx.cpu else 5e-3


def reference(q, ks, vs, n, *, scale, gs, bits, v_fmt=None, rotate=False, sinks=None, mask=None):
    """Attention in float64 over every token so far: the rows before ``n``
    dequantized as the cache stored them, the rest exact."""
    vg, vb = v_fmt or (gs, bits)
    K, V = to_f64(mx.concatenate(ks, axis=2)), to_f64(mx.concatenate(vs, axis=2))
    D = K.shape[-1]
    H = hadamard64(D) if rotate else np.eye(D)
    kq = dequantize64(quantize(mx.array(K @ H, mx.float32), gs, bits), gs, bits) @ H
    vq = dequantize64(quantize(mx.array(V @ H, mx.float32), vg, vb), vg, vb) @ H
    K[:, :, :n], V[:, :, :n] = kq[:, :, :n], vq[:, :, :n]
    q64 = to_f64(q)
    B, Hq, L, _ = q64.shape
    N, rep = K.shape[2], Hq // K.shape[1]
    vis = np.ones((L, N), bool) if mask is None else np.array(mask)
    if isinstance(mask, str):
        vis = np.arange(N)[None, :] <= np.arange(L)[:, None] + N - L
    out = np.zeros((B, Hq, L, V.shape[-1]))
    for b in range(B):
        for h in range(Hq):
            s = np.where(vis, scale * q64[b, h] @ K[b, h // rep].T, -np.inf)
            m = s.max(-1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, float(sinks[h].item()))
            p = np.exp(s - m)
            den = p.sum(-1, keepdims=True)
            if sinks is not None:
                den = den + np.exp(float(sinks[h].item()) - m)
            out[b, h] = p @ V[b, h // rep] / den
    return out


STEPS = [5, 1, 1, 7, 1, 20, 1, 1, 3, 300, 1, 2]


def in_order(split):
    """A fetch's exact rows oldest first (a decode step's come in ring order)."""
    if split.columns is None:
        return split.exact
    return split.exact[..., mx.array(np.argsort(split.exact_columns)), :]


@pytest.mark.parametrize(
    "gs,bits,v_fmt,rotate,R",
    [
        (64, 4, None, False, 8),
        (64, 4, None, True, 16),
        (64, 8, (32, 4), False, 32),
        (32, 3, None, True, 1),
    ],
)
def test_attention_reads_the_window_exactly(rng, gs, bits, v_fmt, rotate, R):
    vg, vb = v_fmt or (None, None)
    cache = mlxq.QuantizedKVCache(gs, bits, hadamard=rotate, v_group_size=vg, v_bits=vb, recent=R)
    plain = mlxq.QuantizedKVCache(gs, bits, hadamard=rotate, v_group_size=vg, v_bits=vb)
    ks, vs = [], []
    sinks = mx.array(rng.normal(0.5, 1.5, 4).astype(np.float32))
    for T in STEPS:
        k, v = kv(rng, T, D=64)
        ks.append(k)
        vs.append(v)
        prev = cache.offset
        K, V = cache.update_and_fetch(k, v)
        assert isinstance(K, RecentSplit) and isinstance(V, RecentSplit)
        n = K.quantized_length
        assert n == max(0, prev - R) and K.exact.shape[2] == cache.offset - n
        # Every token also lands in the quantized buffers, exactly as without a window.
        pk, pv = plain.update_and_fetch(k, v)
        assert_same(parts(cache.keys_and_values()[0]), parts(pk))
        assert_same(parts(cache.keys_and_values()[1]), parts(pv))
        q = mx.array(rng.standard_normal((1, 4, T, 64)).astype(np.float32))
        mask = "causal" if T > 1 else None
        out = mlxq.sdpa(q, K, V, scale=0.125, mask=mask, sinks=sinks)
        ref = reference(
            q,
            ks,
            vs,
            n,
            scale=0.125,
            gs=gs,
            bits=bits,
            v_fmt=v_fmt,
            rotate=rotate,
            sinks=sinks,
            mask=mask,
        )
        assert np.max(np.abs(to_f64(out) - ref)) < tolerance(), f"T={T}"


@pytest.mark.parametrize(
    "gs,bits,v_fmt,rotate,mask",
    [
        (64, 4, None, False, "causal"),
        (64, 4, None, True, "array"),
        (64, 8, (32, 4), False, None),
        (32, 3, None, True, "causal"),
    ],
)
@pytest.mark.parametrize("in_workspace", [True, False])
@pytest.mark.parametrize("buffers", ["fetch", "longer", "quantized rows"])
@pytest.mark.parametrize("ring", [False, True])
def test_one_pass_prefill_attends_the_dequantized_rows_then_the_window(
    rng, gs, bits, v_fmt, rotate, mask, in_workspace, buffers, ring
):
    """A GPU prefill step whose problem MLX's fused attention takes runs as
    one mx.fast call over [dequantized rows, window rows] (the two-part path
    would attend the step's own rows densely in float32). The op does it
    (csrc/prefill_route.h: ExactRows): buffers of at least every row of
    the step (the fetch's, or the cache's longer ones) dequantized into the
    stream's workspace and the window written over its columns; else (the
    quantized rows alone, or the workspace off) the quantized rows
    dequantized apart and joined to the window. Rows in the Hadamard basis
    are dequantized and turned back in Python. Checked here through the
    same functions on this device's mx.fast."""
    from mlxq import _ext, routing, workspace
    from mlxq.attention import _dequantized_one_pass, _one_pass_prefill

    if rotate and buffers != "fetch":
        pytest.skip("rows in the Hadamard basis are dequantized in Python from the fetch")
    if ring and buffers == "longer":
        pytest.skip("a ring's fetch is its buffers")
    vg, vb = v_fmt or (None, None)
    fmt = dict(hadamard=rotate, v_group_size=vg, v_bits=vb, recent=16)
    if ring:  # (a sliding-window ring that has not wrapped yet)
        cache = mlxq.RotatingQuantizedKVCache(256, 0, gs, bits, **fmt)
    else:
        cache = mlxq.QuantizedKVCache(gs, bits, **fmt)
    sinks = mx.array(rng.normal(0.5, 1.5, 4).astype(np.float32))
    ks, vs = [], []
    for T in [40, 1, 1, 24]:
        k, v = kv(rng, T, D=64)
        ks.append(k)
        vs.append(v)
        K, V = cache.update_and_fetch(k, v)
    assert K.columns is None and K.quantized_length == 42 - 16
    N, n = cache.offset, K.quantized_length
    assert parts(K.quantized)[0].shape[2] == N  # the step's rows too (RecentSplit.rows)
    vis = None
    if mask == "array":
        vis = rng.random((24, N)) < 0.6
        vis[:, 0] = True
    m = mx.array(vis) if mask == "array" else mask
    q = mx.array(rng.standard_normal((1, 4, 24, 64)).astype(np.float32))
    if mx.default_device() == mx.cpu:
        assert not _one_pass_prefill(q, K, V, m, sinks, None)  # (only where MLX's route is)
    workspace.release_all()
    was = routing.set_prefill_workspace(in_workspace)
    try:
        if rotate:
            out = _dequantized_one_pass(
                q, K, V, scale=0.125, mask=m, sinks=sinks, stream=None, formats={}
            )
        else:
            kq, vq, rows = parts(K.quantized), parts(V.quantized), n
            if buffers == "longer":
                assert parts(cache.keys)[0].shape[2] > N
                kq, vq = parts(cache.keys), parts(cache.values)
            elif buffers == "quantized rows":
                kq, vq, rows = parts(K.quantized_rows), parts(V.quantized_rows), None
            out = _ext._dequantized_attention(
                q,
                *kq,
                *vq,
                scale=0.125,
                causal=mask == "causal",
                sinks=sinks,
                group_size=gs,
                bits=bits,
                v_group_size=vg or gs,
                v_bits=vb or bits,
                exact_keys=K.exact,
                exact_values=V.exact,
                rows=rows,
            )
        mx.eval(out)
    finally:
        routing.set_prefill_workspace(was)
    reused = in_workspace and not rotate and buffers != "quantized rows"
    assert (workspace.held_bytes() > 0) == reused
    workspace.release_all()
    ref = reference(
        q,
        ks,
        vs,
        n,
        scale=0.125,
        gs=gs,
        bits=bits,
        v_fmt=v_fmt,
        rotate=rotate,
        sinks=sinks,
        mask=vis if mask == "array" else mask,
    )
    assert np.max(np.abs(to_f64(out) - ref)) < tolerance()


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("ring", [False, True])
def test_a_joined_pass_attends_the_dequantized_rows_then_the_window(rng, mask, rotate, ring):
    """On a GPU, a prefill step the op does not route (no fused MLX kernel:
    256-dim heads on CUDA) whose scores fit JOINED_SCORE_BYTES runs as MLX's
    attention over [dequantized rows, window rows]; a row whose mask hides
    every key gets zeros, as mlxq's kernels give it. Checked here through
    the same function on this device's mx.fast."""
    from mlxq.attention import _joined_attention, _joined_prefill

    fmt = dict(hadamard=rotate, recent=16)
    if ring:  # (a sliding-window ring that has not wrapped yet)
        cache = mlxq.RotatingQuantizedKVCache(256, 0, 64, 4, **fmt)
    else:
        cache = mlxq.QuantizedKVCache(64, 4, **fmt)
    ks, vs = [], []
    for T in [40, 1, 1, 24]:
        k, v = kv(rng, T, D=64)
        ks.append(k)
        vs.append(v)
        K, V = cache.update_and_fetch(k, v)
    N, n = cache.offset, K.quantized_length
    vis = None
    m = mask
    if mask in ("bool", "additive"):
        vis = rng.random((24, N)) < 0.6
        vis[:, 0] = True
        vis[5] = False  # a row that sees nothing
        m = mx.array(vis) if mask == "bool" else mx.array(np.where(vis, 0.0, -np.inf), mx.float32)
    q = mx.array(rng.standard_normal((1, 4, 24, 64)).astype(np.float32))
    assert _joined_prefill(q, K, m, None, None) == (mx.default_device() == mx.gpu)
    out = _joined_attention(q, K, V, scale=0.125, mask=m, sinks=None, stream=None)
    with np.errstate(invalid="ignore"):  # (the row that sees nothing: NaN, then 0)
        ref = reference(
            q,
            ks,
            vs,
            n,
            scale=0.125,
            gs=64,
            bits=4,
            rotate=rotate,
            mask=vis if vis is not None else mask,
        )
    if vis is not None:
        ref[:, :, ~vis.any(-1)] = 0.0
    got = to_f64(out)
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - ref)) < tolerance()


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("ring", [False, True])
def test_a_windowed_prefill_step_is_routed_by_the_op(rng, mask, ring):
    """On a GPU whose MLX has a fused kernel for the problem, a recent
    window's prefill step is one routed call of the op: the buffers
    dequantized into the workspace, the exact rows written over theirs,
    MLX's attention over both. The CPU takes mlxq's kernels; both match
    the float64 reference."""
    from mlxq import routing

    BF16 = mx.bfloat16
    if ring:
        cache = mlxq.RotatingQuantizedKVCache(1024, 0, 64, 4, recent=16)
    else:
        cache = mlxq.QuantizedKVCache(64, 4, recent=16)
    ks, vs = [], []
    for T in [300, 64]:
        k, v = kv(rng, T, D=64, dtype=BF16)
        ks.append(k)
        vs.append(v)
        K, V = cache.update_and_fetch(k, v)
    n = K.quantized_length
    assert n == 300 - 16 and K.rows == n
    q = mx.array(rng.standard_normal((1, 8, 64, 64)).astype(np.float32)).astype(BF16)
    routing.take_route_counts()
    out = mlxq.sdpa(q, K, V, scale=0.125, mask=mask)
    mx.eval(out)
    routed = routing.take_route_counts().get("mx_fast", 0)
    expected = routing.gpu_backend() is not None and mx.default_device() == mx.gpu
    assert routed == int(expected), f"routed {routed} calls"
    ref = reference(q, ks, vs, n, scale=0.125, gs=64, bits=4, mask=mask)
    assert_close(out, ref, BF16)


@pytest.mark.parametrize("mask", [None, "causal", "array"])
@pytest.mark.parametrize("sinks_dtype", [None, mx.float32, mx.bfloat16])
def test_a_first_chunk_attends_its_exact_rows_alone(rng, mask, sinks_dtype):
    """A window cache's first prefill chunk has no quantized row: on a GPU
    it attends its exact rows through mx.fast where that takes the mask and
    sinks (else float32 MLX ops), with mlxq's zeros for a row that sees no
    key. Checked here through the same function."""
    from mlxq.attention import _exact_only

    L = T = 24
    k, v = kv(rng, T, D=64)
    k, v = k.astype(mx.bfloat16), v.astype(mx.bfloat16)
    q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32)).astype(mx.bfloat16)
    sinks = None
    if sinks_dtype is not None:
        sinks = mx.array(rng.normal(0.5, 1.5, 4).astype(np.float32)).astype(sinks_dtype)
    vis = np.tril(np.ones((L, T), bool)) if mask != "array" else rng.random((L, T)) < 0.6
    if mask == "array":
        vis[:, 0] = True
        vis[5] = False  # a row that sees no key: zeros (the sink's value with sinks)
    m = mx.array(vis) if mask == "array" else mask
    out = _exact_only(q, k, v, 0.125, m, sinks, None)
    K, V = np.repeat(to_f64(k), 2, axis=1), np.repeat(to_f64(v), 2, axis=1)
    s = np.einsum("bhld,bhnd->bhln", to_f64(q), K) * 0.125
    if mask is not None:
        s = np.where(vis, s, -np.inf)
    if sinks is not None:
        sink = np.broadcast_to(to_f64(sinks)[None, :, None, None], s.shape[:3] + (1,))
        s = np.concatenate([s, sink], axis=-1)
        V = np.concatenate([V, np.zeros_like(V[:, :, :1])], axis=2)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(top), 0.0, top))
    total = p.sum(-1, keepdims=True)
    ref = np.einsum("bhln,bhnd->bhld", p / np.where(total == 0, 1.0, total), V)
    assert np.max(np.abs(to_f64(out) - ref)) < 2e-2


@pytest.mark.parametrize("sinks_on", [False, True])
@pytest.mark.parametrize("steps", [[40], [40, 24]])
def test_a_sliding_window_chunk_takes_the_window_kernel_on_the_cpu(
    rng, monkeypatch, sinks_on, steps
):
    """A sliding-window layer's prompt chunk comes with a band mask array.
    On the CPU mlxq's window kernel attends the chunk's exact rows through
    that mask (recent_attention), never float32 MLX matmuls
    (dense_attention_with_lse), which score every key and double Gemma 3's
    time to first token against 4-bit without the window."""
    import mlxq.attention as attention

    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU route: a GPU joins a sliding chunk's rows for mx.fast")

    def refuse(*args, **kwargs):
        raise AssertionError("the float32 MLX path attended the window")

    monkeypatch.setattr(attention, "dense_attention_with_lse", refuse)
    cache = mlxq.QuantizedKVCache(64, 4, recent=16)
    sinks = mx.array(rng.normal(0.5, 1.5, 4).astype(np.float32)) if sinks_on else None
    ks, vs = [], []
    for T in steps:
        k, v = kv(rng, T, D=64)
        ks.append(k)
        vs.append(v)
        K, V = cache.update_and_fetch(k, v)
        N = cache.offset
        j, i = np.arange(N)[None, :], np.arange(T)[:, None] + N - T
        vis = (j <= i) & (j > i - 12)  # a 12-token sliding window
        q = mx.array(rng.standard_normal((1, 4, T, 64)).astype(np.float32))
        out = mlxq.sdpa(q, K, V, scale=0.125, mask=mx.array(vis), sinks=sinks)
        n = K.quantized_length
        ref = reference(q, ks, vs, n, scale=0.125, gs=64, bits=4, sinks=sinks, mask=vis)
        assert np.max(np.abs(to_f64(out) - ref)) < tolerance(), f"T={T}, n={n}"


@pytest.mark.parametrize("L", [5, 1])
def test_an_array_mask_is_cut_at_the_window(rng, L):
    # L = 1: a decode step with a full window, whose exact rows come in ring order.
    cache = mlxq.QuantizedKVCache(64, 4, recent=6)
    ks, vs = [], []
    for T in [10, 1, L]:
        k, v = kv(rng, T, D=64)
        ks.append(k)
        vs.append(v)
        K, V = cache.update_and_fetch(k, v)
    assert (K.columns is not None) == (L == 1)
    N = cache.offset
    vis = rng.random((L, N)) < 0.6
    vis[:, 0] = True
    q = mx.array(rng.standard_normal((1, 2, L, 64)).astype(np.float32))
    out = mlxq.sdpa(q, K, V, scale=0.125, mask=mx.array(vis))
    ref = reference(q, ks, vs, K.quantized_length, scale=0.125, gs=64, bits=4, mask=vis)
    assert np.max(np.abs(to_f64(out) - ref)) < tolerance()
    with pytest.raises(ValueError, match="mask covers"):
        mlxq.sdpa(q, K, V, scale=0.125, mask=mx.array(vis[:, 1:]))


def test_restored_and_trimmed_caches_read_what_they_no_longer_hold_quantized(rng):
    cache = mlxq.QuantizedKVCache(64, 4, recent=8)
    cache.update_and_fetch(*kv(rng, 30, D=64))
    restored = mlxq.QuantizedKVCache.from_state(cache.state)
    restored.recent = 8
    restored._configure()
    K, _ = restored.update_and_fetch(*kv(rng, 1, D=64))
    assert K.quantized_length == 30 and K.exact.shape[2] == 1
    # Trim: the ring held [22, 30); after forgetting 5, [22, 25) is still exact.
    cache.trim(5)
    K, _ = cache.update_and_fetch(*kv(rng, 1, D=64))
    assert K.quantized_length == 22 and K.exact.shape[2] == 4
    # A trim deeper than the window: nothing before the new offset is held.
    cache.trim(12)
    K, _ = cache.update_and_fetch(*kv(rng, 2, D=64))
    assert K.quantized_length == 14 and K.exact.shape[2] == 2


@pytest.mark.parametrize("evaluated", [False, True])
def test_copies_keep_their_own_window(rng, evaluated):
    # evaluated: each step is evaluated before the next is built, so the
    # rings are written in place (decode_rings), but never a ring the other
    # cache shares.
    def update(cache, k, v):
        fetch = cache.update_and_fetch(k, v)
        if evaluated:
            mx.eval([(x.quantized, x.exact) for x in fetch])
        return fetch

    a = mlxq.QuantizedKVCache(64, 4, recent=4)
    update(a, *kv(rng, 6, D=64))
    for _ in range(3):
        update(a, *kv(rng, 1, D=64))
    b = copy.copy(a)
    mine = kv(rng, 1, D=64)
    ka, _ = update(a, *mine)
    kb_, _ = update(b, *kv(rng, 1, D=64))
    # Same history, different last tokens: the windows differ only there.
    ka, kb_ = in_order(ka), in_order(kb_)
    assert_same(ka[..., :4, :], kb_[..., :4, :])
    assert not mx.array_equal(ka[..., 4:, :], kb_[..., 4:, :]).item()
    # Both keep decoding on their own rings (written in place from here):
    # a's window is a's last five tokens whatever b writes.
    mine = [mine[0]]
    for _ in range(6):
        k = kv(rng, 1, D=64)
        mine.append(k[0])
        ka, _ = update(a, *k)
        update(b, *kv(rng, 1, D=64))
    assert_same(in_order(ka), mx.concatenate(mine[-5:], axis=2))
    assert a.nbytes > mlxq.QuantizedKVCache(64, 4).nbytes


def test_to_quantized_starts_with_an_exact_window(rng):
    plain = mlxq.KVCache()
    k, v = kv(rng, 40, D=64)
    plain.update_and_fetch(k, v)
    cache = plain.to_quantized(64, 4, recent=16)
    K, V = cache.update_and_fetch(*kv(rng, 1, D=64))
    assert K.quantized_length == 24
    assert_same(in_order(K)[..., :16, :], k[..., 24:, :])


def test_bad_window_sizes_are_refused():
    with pytest.raises(ValueError, match="recent must be >= 0"):
        mlxq.QuantizedKVCache(64, 4, recent=-1)
    with pytest.raises(ValueError, match="kv_recent"):
        mlxq_lm.enable(kv_recent=-3)


def test_mismatched_splits_are_refused(rng):
    cache = mlxq.QuantizedKVCache(64, 4, recent=4)
    cache.update_and_fetch(*kv(rng, 10, D=64))
    K, V = cache.update_and_fetch(*kv(rng, 1, D=64))
    q = mx.zeros((1, 2, 1, 64))
    with pytest.raises(ValueError, match="both be recent-window"):
        mlxq.sdpa(q, K, V.quantized, scale=0.1)
    with pytest.raises(ValueError, match="mask must be None"):
        mlxq.sdpa(q, K, V, scale=0.1, mask="full")
    with pytest.raises(ValueError, match="cut at the same position"):
        mlxq.sdpa(q, K, RecentSplit(V.quantized, V.exact[..., 1:, :]), scale=0.1)


@pytest.mark.parametrize("held", [tuple, list])
def test_longer_buffers_attend_their_first_rows_only(rng, held):
    # A cache may hand over whole buffers with the row count (rows=); a
    # distributed rank's cache holds them as lists.
    cache = mlxq.QuantizedKVCache(64, 4, recent=4)
    cache.update_and_fetch(*kv(rng, 10, D=64))
    K, V = cache.update_and_fetch(*kv(rng, 1, D=64))
    n = K.quantized_length

    def padded(part):
        extra = [mx.array(rng.integers(0, 255, a.shape), a.dtype) for a in parts(part.quantized)]
        longer = [mx.concatenate([a, e], axis=2) for a, e in zip(parts(part.quantized), extra)]
        return RecentSplit(held(longer), part.exact, rows=n)

    q = mx.array(rng.standard_normal((1, 2, 1, 64)), mx.float32)
    Kp, Vp = padded(K), padded(V)
    assert type(Kp.quantized_rows) is held
    assert [a.shape[2] for a in Kp.quantized_rows] == [n] * 3
    want = mlxq.sdpa(q, K, V, scale=0.125)
    got = mlxq.sdpa(q, Kp, Vp, scale=0.125, group_size=64, bits=4)
    assert np.array_equal(np.array(got), np.array(want))


def generate(model, prompt, n, **kw):
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, **kw)
    return [int(tok) for (tok, _), _i in zip(steps, range(n))]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_window_over_everything_generates_as_unquantized(arch):
    # With a window longer than prompt + generation every key is read
    # exactly: kv_bits=4 must then give the unquantized run's greedy tokens
    # (on the CPU, where the dense window's f32 matmuls are exact). gemma3's
    # sliding layers clamp the window to their ring, which it then covers.
    if mx.default_device() != mx.cpu:
        pytest.skip("exact only where f32 matmuls are (CUDA's round like TF32)")
    model, _ = random_model(arch, seed=3, dtype=mx.float32)
    prompt = list(range(3, 60))
    want = generate(model, prompt, 24)
    with mlxq_lm.enable(kv_recent=128):
        mlxq_lm.reset_counters()
        got = generate(model, prompt, 24, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
        assert mlxq_lm.counters()["mlxq"] > 0
    assert got == want
    assert mlxq_lm.settings().kv_recent is None  # disable() resets it: the recipe


def test_a_short_window_still_generates_and_stays_near_unquantized():
    model, _ = random_model("llama", seed=5, dtype=mx.float32)
    prompt = list(range(3, 90))
    with mlxq_lm.enable(kv_recent=16):
        got = generate(model, prompt, 32, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    assert len(got) == 32


def test_cli_kv_recent(capsys):
    from mlxq.generate import main

    args = ["--random-model", "llama", "--max-tokens", "4", "--prompt-tokens", "40"]
    main(args + ["--kv-bits", "4", "--kv-recent", "16"])
    out, _ = capsys.readouterr()
    assert "Generation: 4 tokens" in out and mlxq_lm.settings().kv_recent is None
    with pytest.raises(SystemExit):
        main(args + ["--kv-recent", "16"])  # without --kv-bits


@pytest.mark.parametrize(
    "bits, recent, max_kv_size, want",
    [
        (4, None, None, 128),  # the recipe
        (2, None, None, 128),
        (5, None, None, 0),  # above 4 bits: none unless asked
        (8, None, None, 0),
        (4, 0, None, 0),  # turned off by name
        (8, 32, None, 32),
    ],
)
def test_the_recipe_is_what_kv_bits_gets(bits, recent, max_kv_size, want, capsys):
    """Under enable(), caches of at most 4 bits keep the last 128 tokens
    exact unless kv_recent says otherwise, and mlxq-generate says which."""
    from mlxq.generate import main

    model, _ = random_model("llama", seed=2)
    with mlxq_lm.enable(kv_recent=recent):
        from mlx_lm.models.cache import make_prompt_cache  # (enable() replaces it)

        assert mlxq_lm.settings().recent_for(bits) == (want if max_kv_size is None else 128)
        caches = make_prompt_cache(model, max_kv_size, kv_bits=bits)
    # (the values' bits: the recipe's keys are tests/lm/test_recipe.py's)
    assert {(c.format.v_bits, c.recent) for c in caches} == {(bits, want)}
    if max_kv_size is None:
        args = ["--random-model", "llama", "--max-tokens", "2", "--prompt-tokens", "20"]
        args += ["--kv-bits", str(bits)] + ([] if recent is None else ["--kv-recent", str(recent)])
        main(args)
        err = capsys.readouterr().err
        assert (f"the last {want} tokens exact" in err) == bool(want), err
        assert ("--kv-recent 0 turns it off" in err) == (recent is None and bits <= 4), err


def test_the_setting_printed_names_the_window_a_max_kv_size_ring_holds():
    # mlx-lm's max_kv_size rings (models without their own caches) keep 4
    # tokens and hold at most max_size - 5 of the window.
    settings = mlxq_lm.Settings()
    assert "the last 128 tokens exact" in settings.describe(4, 64)
    assert "the last 35 tokens exact" in settings.describe(4, 64, max_kv_size=40)
    assert "exact" not in settings.describe(4, 64, max_kv_size=5)
    assert "the last 128 tokens exact" in settings.describe(4, 64, max_kv_size=4096)


def test_the_recipe_passes_by_caches_that_keep_no_window():
    """Chunked-attention caches keep no window: the recipe leaves them
    without one (no error), a kv_recent asked for by name is refused; a
    sliding window's ring keeps what fits. (MLA latent caches:
    tests/lm/test_mla.py.)"""
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    from mlxq.mlx_lm.caches import quantize_caches
    from mlxq.mlx_lm.settings import Settings

    def chunked():
        c = ChunkedKVCache(16)
        c.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
        return c

    ring = RotatingKVCache(40, keep=4)
    ring.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    caches = [chunked(), ring]
    quantize_caches(caches, 0, 64, 4, Settings())
    assert caches[1].recent == 40 - 4 - 1  # a ring's window holds at most this
    assert isinstance(caches[0], mlxq.ChunkedQuantizedKVCache) and caches[0].v_bits == 4
    with pytest.raises(ValueError, match="kv_recent=0"):
        quantize_caches([chunked()], 0, 64, 4, Settings(kv_recent=16))


ROTATING_STEPS = [5, 1, 1, 7] + [1] * 40 + [20] + [1] * 12 + [3] + [1] * 6


def attend64(q, K, V, vis, scale):
    """Float64 attention of q [B, Hq, L, D] over K/V [B, Hkv, N, D] (GQA) where ``vis``."""
    B, Hq, L, _ = q.shape
    rep = Hq // K.shape[1]
    out = np.zeros((B, Hq, L, V.shape[-1]))
    for b in range(B):
        for h in range(Hq):
            s = np.where(vis, scale * q[b, h] @ K[b, h // rep].T, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, h] = p @ V[b, h // rep] / p.sum(-1, keepdims=True)
    return out


@pytest.mark.parametrize(
    "max_size,keep,R,gs,bits,rotate,window",
    [
        (32, 0, 8, 64, 4, False, None),
        (32, 4, 8, 64, 4, True, 24),
        (24, 0, 1, 32, 3, False, None),
        (40, 2, 20, 64, 8, False, 16),
    ],
)
def test_a_sliding_window_cache_reads_its_window_exactly(
    rng, max_size, keep, R, gs, bits, rotate, window
):
    # RotatingQuantizedKVCache(recent=R) against float64 over the columns
    # the same ring fetches without a window: its window's tokens exact, the
    # rest as quantized. Three plain rings in lockstep give each column's
    # exact K/V, stored codes and position (mlxq's rings follow mlx-lm's).
    cache = mlxq.RotatingQuantizedKVCache(max_size, keep, gs, bits, rotate, recent=R)
    plain = mlxq.RotatingQuantizedKVCache(max_size, keep, gs, bits, rotate)
    exact, where = mlxq.RotatingKVCache(max_size, keep), mlxq.RotatingKVCache(max_size, keep)
    H = hadamard64(64) if rotate else np.eye(64)
    for T in ROTATING_STEPS:
        k, v = kv(rng, T, D=64)
        pos = mx.broadcast_to(
            mx.arange(cache.offset, cache.offset + T, dtype=mx.float32)[None, None, :, None],
            (1, 1, T, 1),
        )
        mask = cache.make_mask(T, window_size=window)
        K, V = cache.update_and_fetch(k, v)
        QK, QV = plain.update_and_fetch(k, v)
        EK, EV = exact.update_and_fetch(k, v)
        P = to_f64(where.update_and_fetch(pos, pos)[0])[0, 0, :, 0]
        lo = cache.offset - K.exact.shape[2]
        assert K.exact.shape[2] == min(cache.offset, R + T if T > 1 else R + 1)
        if T == 1:  # the ring with the window's slots hidden
            assert (
                K.quantized_length == len(P) and (~np.array(K.visible)).sum() == cache.offset - lo
            )
            assert np.array_equal(np.sort(P[~np.array(K.visible)]), np.arange(lo, cache.offset))
        Kd = np.where(P[:, None] >= lo, to_f64(EK), dequantize64(QK, gs, bits) @ H)
        Vd = np.where(P[:, None] >= lo, to_f64(EV), dequantize64(QV, gs, bits) @ H)
        q = mx.array(rng.standard_normal((1, 4, T, 64)).astype(np.float32))
        out = mlxq.sdpa(q, K, V, scale=0.125, mask=mask)
        vis = mask64(mask, (1, 1, T, len(P)))[0][0, 0]
        ref = attend64(to_f64(q), Kd, Vd, vis, 0.125)
        assert np.max(np.abs(to_f64(out) - ref)) < tolerance(), f"T={T} offset={cache.offset}"


def test_a_sliding_window_cache_refuses_a_window_that_does_not_fit():
    with pytest.raises(ValueError, match="recent"):
        mlxq.RotatingQuantizedKVCache(32, 4, 64, 4, recent=28)
    plain = mlxq.RotatingKVCache(64)
    plain.update_and_fetch(*kv(np.random.default_rng(0), 70, D=64))
    cache = plain.to_quantized(64, 4, recent=16)
    K, _ = cache.update_and_fetch(*kv(np.random.default_rng(1), 1, D=64))
    assert K.exact.shape[2] == 17 and (~np.array(K.visible)).sum() == 17


def test_a_lazily_evaluated_loop_of_steps_reads_what_each_step_saw(rng):
    # One-token steps built back to back and evaluated once at the end (a
    # teacher-forced loop): each step overwrites the ring slot the step before
    # it read, so that read must still see its own token, not the next one.
    cache = mlxq.QuantizedKVCache(64, 8, recent=3)
    k, v = kv(rng, 6, D=64)
    cache.update_and_fetch(k, v)
    tokens = [k]
    seen = []
    for _ in range(6):
        k, v = kv(rng, 1, D=64)
        tokens.append(k)
        K, _ = cache.update_and_fetch(k, v)
        seen.append((cache.offset, in_order(K)))
    mx.eval([s for _, s in seen])
    every = mx.concatenate(tokens, axis=2)
    for offset, window in seen:
        assert_same(window, every[..., offset - 4 : offset, :])


def test_a_window_taken_from_a_batch_stays_while_the_batch_decodes(rng):
    # extract() builds the sequence's window from views of the batch's
    # rings, lazily; the batch's next evaluated steps must not write those
    # rings in place under it.
    batch = mlxq.BatchQuantizedKVCache([0, 0], group_size=64, bits=4, recent=4)
    k = mx.array(rng.standard_normal((2, 2, 9, 64)).astype(np.float32))
    evaluate = lambda fetch: mx.eval([(x.quantized, x.exact) for x in fetch])  # noqa: E731
    evaluate(batch.update_and_fetch(k, k))
    rows = [k]
    for _ in range(2):
        k = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float32))
        rows.append(k)
        evaluate(batch.update_and_fetch(k, k))
    one = batch.extract(1)
    for _ in range(6):
        k = mx.array(rng.standard_normal((2, 2, 1, 64)).astype(np.float32))
        evaluate(batch.update_and_fetch(k, k))
    k = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32))
    K, _ = one.update_and_fetch(k, k)
    want = mx.concatenate([r[1:] for r in rows] + [k], axis=2)[..., -5:, :]
    assert_same(in_order(K), want)


@pytest.mark.parametrize("T", [1, 5])
def test_every_kind_of_stream_argument_is_taken(rng, T):
    # mlxq.sdpa takes what MLX's ops take: None, a stream, a device, or a
    # device type (mx.cpu), for decode steps and longer ones alike.
    cache = mlxq.QuantizedKVCache(64, 4, recent=8)
    cache.update_and_fetch(*kv(rng, 40, D=64))
    K, V = cache.update_and_fetch(*kv(rng, T, D=64))
    q = mx.array(rng.standard_normal((1, 4, T, 64)).astype(np.float32))
    device = mx.default_device()
    want = mlxq.sdpa(q, K, V, scale=0.125, mask="causal" if T > 1 else None)
    for stream in (device.type, device, mx.default_stream(device)):
        got = mlxq.sdpa(q, K, V, scale=0.125, mask="causal" if T > 1 else None, stream=stream)
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("fmt", [dict(bits=8), dict(v_bits=8), dict(v_group_size=32)])
def test_a_decode_step_checks_the_formats_it_is_given(rng, fmt):
    # Formats passed to mlxq.sdpa are checked against the fetch's rows on a
    # decode step too (not inferred from the shapes over them).
    cache = mlxq.QuantizedKVCache(64, 4, recent=8)
    cache.update_and_fetch(*kv(rng, 40, D=64))
    K, V = cache.update_and_fetch(*kv(rng, 1, D=64))
    q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    with pytest.raises(ValueError, match=r"^\[mlxq\.quantized_sdpa\] "):
        mlxq.sdpa(q, K, V, scale=0.125, **fmt)
    mx.eval(mlxq.sdpa(q, K, V, scale=0.125, group_size=64, bits=4, v_bits=4))


@pytest.mark.parametrize("size", [3, 128, 600])
def test_ring_orders_are_each_slots_index_in_the_window(size):
    # A decode step's columns: slot i of a full ring whose oldest token is
    # at slot s is the window's (i - s) mod slots-th row; shared tables up
    # to 512 slots, computed per step beyond.
    from mlxq.cache.recent import RecentWindow

    w = RecentWindow(size)
    for shift in {0, 1, size // 2, size}:
        want = (np.arange(size + 1) - shift) % (size + 1)
        assert np.array_equal(w._order(shift), want)


@pytest.mark.parametrize("length, keep", [(40, 0), (40, 4), (1500, 0)])
def test_a_rings_visibility_is_all_but_the_newest_slots(length, keep):
    # What a sliding ring's decode step reads quantized: every slot but the
    # k newest tokens', going back from `newest` and wrapping from `keep`.
    # Kept (one evaluated array per ring position) up to 1024 rows; every
    # position's at the second position asked.
    from mlxq.cache.rotating import _visibility_table, ring_visible

    span, k = length - keep, 9
    _visibility_table.cache_clear()
    for i, newest in enumerate((0, 5, span - 1)):
        got = ring_visible(length, keep, span, k, newest)
        want = np.ones(length, bool)
        want[[keep + (newest - j) % span for j in range(k)]] = False
        assert np.array_equal(np.array(got), want)
        again = ring_visible(length, keep, span, k, newest)
        assert (again is got) == (length <= 1024)
        if length <= 1024:  # the second position makes every position's
            assert len(_visibility_table(length, keep, span, k)) == (1 if i == 0 else span)
