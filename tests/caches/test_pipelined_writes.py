"""Cache writes stay in place under mlx-lm's async_eval pipelining.

generate_step builds step t+1 and async_evals it while step t still runs, so
MLX's in-flight command buffers (and the previous step's fetched views) still
share the cache's memory when the next write is evaluated. A write that only
updates in place when MLX calls the buffer donatable would then copy the whole
cache every token (O(N) time and a second buffer of peak memory). The caches
own their buffers and write them in place regardless: these tests run a
pipelined decode loop over a large cache and require zero copies (mlxq's copy
counter, which every backend's write path increments) and no growth of peak
memory beyond the step's own small arrays.
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import assert_close
from support.reference64 import sdpa64

import mlxq

H, D, GS, BITS = 4, 128, 64, 4


def _prefilled(kind, N):
    # Prefill N - 64 tokens: the growing caches' decode steps stay inside
    # their last 256-token growth step, and the rings (N - 56 slots) wrap
    # after 8 steps.
    ring = N - 56
    if kind == "quantized":
        cache = mlxq.QuantizedKVCache(group_size=GS, bits=BITS)
    elif kind == "quantized-recent":  # its window's rings too
        cache = mlxq.QuantizedKVCache(group_size=GS, bits=BITS, recent=128)
    elif kind == "rotating-quantized":
        cache = mlxq.RotatingQuantizedKVCache(max_size=ring, group_size=GS, bits=BITS)
    elif kind == "rotating":
        cache = mlxq.RotatingKVCache(max_size=ring)
    else:
        cache = mlxq.KVCache()
    x = mx.random.normal((1, H, N - 64, D)).astype(mx.bfloat16)
    cache.update_and_fetch(x, x)
    mx.eval(cache.keys, cache.values)
    return cache


def _decode(cache, steps, q):
    """A pipelined decode loop, as generate_step runs it: each step's new K/V
    depend on the previous step's attention output, and step t+1 is
    async_eval'ed before step t is waited on."""
    outs, pending = [], None
    h = q
    for _ in range(steps):
        k = (h * 0.5).astype(mx.bfloat16)
        v = (h * 0.25 + 1.0).astype(mx.bfloat16)
        keys, values = cache.update_and_fetch(k, v)
        h = mlxq.sdpa(q + h * 1e-3, keys, values, scale=D**-0.5)
        mx.async_eval(h)
        if pending is not None:
            mx.eval(pending)
            outs.append(pending)
        pending = h
    mx.eval(pending)
    outs.append(pending)
    return outs


@pytest.mark.parametrize(
    "kind", ["quantized", "quantized-recent", "rotating-quantized", "plain", "rotating"]
)
def test_pipelined_decode_never_copies_the_cache(device, kind):
    N = 1 << 14
    cache = _prefilled(kind, N)
    q = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
    _decode(cache, 2, q)  # first writes after prefill may copy a broadcast zero buffer
    mlxq._ext._take_ring_copies()
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    _decode(cache, 24, q)
    assert mlxq._ext._take_ring_copies() == 0
    # A copied buffer would add cache.nbytes / 2 (K or V) at once.
    grown = mx.get_peak_memory() - base
    assert grown < cache.nbytes / 8, f"peak grew {grown} bytes over a {cache.nbytes}-byte cache"


def test_pipelined_quantized_decode_is_exact(device):
    """The in-place loop computes what an unpipelined one over copies does."""
    N = 1024
    q = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
    mx.random.seed(3)
    a = _prefilled("quantized", N)
    mx.random.seed(3)
    b = _prefilled("quantized", N)
    got = _decode(a, 12, q)
    h, want = q, []
    for _ in range(12):
        k = (h * 0.5).astype(mx.bfloat16)
        v = (h * 0.25 + 1.0).astype(mx.bfloat16)
        keys, values = b.update_and_fetch(k, v)
        mx.eval(keys, values)
        ref = sdpa64(q + h * 1e-3, keys, values, scale=D**-0.5, group_size=GS, bits=BITS)
        h = mlxq.sdpa(q + h * 1e-3, keys, values, scale=D**-0.5)
        mx.eval(h)
        assert_close(h, ref, mx.bfloat16)
        want.append(h)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(
            np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
        )


def test_adopted_buffers_are_copied_while_their_owner_holds_them(device):
    """restore() takes buffers the caller still holds: the first write must
    not change the caller's arrays (it copies), later ones are in place."""
    x = mx.random.normal((1, H, 300, D)).astype(mx.bfloat16)
    triple_k = tuple(mx.quantize(x, group_size=GS, bits=BITS))
    triple_v = tuple(mx.quantize(x * 2, group_size=GS, bits=BITS))
    mx.eval(triple_k, triple_v)

    def raw(a):
        return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)

    before = [raw(a) for a in triple_k]
    cache = mlxq.QuantizedKVCache(group_size=GS, bits=BITS).restore(triple_k, triple_v, 290)
    mlxq._ext._take_ring_copies()
    new = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
    mx.eval(cache.update_and_fetch(new, new))
    assert mlxq._ext._take_ring_copies() == 6  # three arrays each of K and V
    for a, b in zip(triple_k, before):
        np.testing.assert_array_equal(raw(a), b)
    mx.eval(cache.update_and_fetch(new, new))
    assert mlxq._ext._take_ring_copies() == 0


@pytest.mark.parametrize("kind", ["quantized", "rotating-quantized", "plain", "rotating"])
def test_copies_and_states_never_change_under_their_holder(device, kind):
    """In-place writes must not reach arrays someone else holds: a deepcopy
    (which shares MLX buffers, as mlx-lm's evaluate and BatchGenerator use
    it) and a state handed out stay exactly as they were while the original
    cache keeps decoding, and the copy decodes independently of it."""
    import copy

    N = 200
    a = _prefilled(kind, N)
    for _ in range(3):  # own its buffers again after the prefill's first writes
        x = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
        mx.eval(a.update_and_fetch(x, x))
    b = copy.deepcopy(a)
    held = a.state[:2]
    flat = lambda t: [
        np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)  # noqa: E731
        for x in (t if isinstance(t, (tuple, list)) else [t])
    ]
    snapshot = [flat(t) for t in held]
    before_b = [flat(t) for t in (b.keys, b.values)]
    rows = [mx.random.normal((1, H, 1, D)).astype(mx.bfloat16) for _ in range(12)]
    for r in rows:  # the original decodes 12 tokens (wrapping the rings)
        mx.eval(a.update_and_fetch(r, r))
    for got, want in zip([flat(t) for t in held], snapshot):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
    for got, want in zip([flat(t) for t in (b.keys, b.values)], before_b):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
    # The copy then decodes the same tokens and reaches the same content.
    for r in rows:
        mx.eval(b.update_and_fetch(r, r))
    for x, y in zip(flat(a.keys) + flat(a.values), flat(b.keys) + flat(b.values)):
        np.testing.assert_array_equal(x, y)


def test_private_cache_state_reads_keep_writes_in_place(device):
    """A cache only one mlxq-driven loop sees (the ones mlxq's generate_step
    makes: mlx-lm reads their state after each prefill chunk just to
    evaluate it) keeps its buffers on a state read; any other cache copies
    at the next write while the state is held. Its copies are not private."""
    import copy

    def after_state_read(private):
        cache = _prefilled("quantized", 100)
        x = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
        mx.eval(cache.update_and_fetch(x, x))
        cache._private = private
        held = cache.state  # still held at the next write
        mlxq._ext._take_ring_copies()
        mx.eval(cache.update_and_fetch(x, x))
        del held
        return cache, mlxq._ext._take_ring_copies()

    assert after_state_read(False)[1] == 6  # three arrays each of K and V
    private, copies = after_state_read(True)
    assert copies == 0
    assert not copy.deepcopy(private)._private and not private._private


@pytest.mark.parametrize("quantized", [False, True])
def test_a_lazy_loop_past_the_wrap_reads_what_each_step_saw(device, rng, quantized):
    """One-token steps built without any evaluation between them: each
    step's attention must read the ring as it was at that step, although the
    next step overwrites a slot it read. Eager steps are the reference."""
    D, ring = 64, 16

    def make():
        if quantized:
            return mlxq.RotatingQuantizedKVCache(max_size=ring, group_size=64, bits=8)
        return mlxq.RotatingKVCache(max_size=ring)

    prefill = [mx.array(rng.standard_normal((1, 2, 20, D)).astype(np.float32)) for _ in "kv"]
    steps = [
        [mx.array(rng.standard_normal((1, 2, 1, D)).astype(np.float32)) for _ in "kv"]
        for _ in range(24)
    ]
    q = mx.array(rng.standard_normal((1, 2, 1, D)).astype(np.float32))
    outs = {}
    for lazy in (False, True):
        cache = make()
        mx.eval(cache.update_and_fetch(*prefill))
        outs[lazy] = []
        for k, v in steps:
            keys, values = cache.update_and_fetch(k, v)
            outs[lazy].append(mlxq.sdpa(q, keys, values, scale=D**-0.5))
            if not lazy:
                mx.eval(outs[lazy][-1])
        mx.eval(outs[lazy])
    for t, (a, b) in enumerate(zip(outs[False], outs[True])):
        assert mx.array_equal(a, b).item(), f"step {t}: the lazy loop read overwritten slots"
