"""mlxq's caches against mlx-lm's, step by step.

Random scripts of prefill chunks, one-token decode steps (through several
wrap-arounds) and trims run on an mlxq cache and on mlx-lm's cache of the same
class side by side. After every step the fetched keys/values, the offset, the
ring index and every mask variant must be bit-identical, and the quantized
cache running the same script must hold exactly ``mx.quantize`` of the plain
cache's fetch.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm
from support.caches import assert_same, fresh, kv, random_op, random_script
from support.helpers import quantize

import mlxq

QUANT = [(32, 4), (64, 8), (128, 3), (64, 6), (32, 2), (64, 5)]  # (group_size, bits)


def masks_of(cache, max_size=None):
    """Every make_mask variant a model may ask for, in a fixed order."""
    windows = [None, 3] + ([max_size // 2 or 1, max_size + 4] if max_size else [300])
    out = []
    for N, window, return_array in itertools.product((1, 5), windows, (False, True)):
        out.append(cache.make_mask(N, return_array=return_array, window_size=window))
    return out


class Pair:
    """An mlxq cache, mlx-lm's equivalent and mlxq's quantized twin, run in lockstep."""

    def __init__(self, ours, ref, quant, dtype, group_size, bits):
        self.ours, self.ref, self.quant = ours, ref, quant
        self.dtype, self.group_size, self.bits = dtype, group_size, bits
        self.batch = 2 if dtype == mx.bfloat16 else 1  # batches ride along with bf16
        self.max_size = getattr(ref, "max_size", None)
        self.seen = set()  # what the script exercised: "wrap", "trim", "refused", ...

    def update(self, rng, T):
        if self.max_size and self.ref.offset >= self.max_size:
            self.seen.add("wrap" if T == 1 else "reorder")
        k, v = kv(rng, T, B=self.batch, dtype=self.dtype)
        got = self.ours.update_and_fetch(k, v)
        want = self.ref.update_and_fetch(fresh(k), fresh(v))
        assert_same(got, want, f"fetch after a {T}-token step")
        if self.quant is not None:
            qgot = self.quant.update_and_fetch(k, v)
            assert_same(qgot[0], quantize(got[0], self.group_size, self.bits), "quantized keys")
            assert_same(qgot[1], quantize(got[1], self.group_size, self.bits), "quantized values")

    def trim(self, n):
        if self.ref.is_trimmable():
            self.seen.add("trim" if n else "trim0")
            n_ref = self.ref.trim(n)
            assert self.ours.trim(n) == n_ref
            if self.quant is not None:
                assert self.quant.trim(n) == n_ref
        else:
            assert not self.ours.is_trimmable()
            if n:
                self.seen.add("refused")
                with pytest.raises(ValueError, match="ring is full"):
                    self.ours.trim(n)

    def check(self):
        ours, ref = self.ours, self.ref
        assert ours.offset == ref.offset
        assert ours.size() == ref.size()
        assert ours.is_trimmable() == ref.is_trimmable()
        assert ours.nbytes == ref.nbytes
        if hasattr(ref, "_idx"):
            assert ours.ring_index == ref._idx
        pairs = zip(masks_of(ours, self.max_size), masks_of(ref, self.max_size))
        for i, (a, b) in enumerate(pairs):
            assert_same(a, b, f"mask variant {i}")
        if self.quant is not None:  # (its masks come from the same code as ours)
            assert self.quant.offset == ours.offset
            assert getattr(self.quant, "ring_index", None) == getattr(ours, "ring_index", None)

    def run_random(self, rng, n_ops, **limits):
        for _ in range(n_ops):
            self.run(rng, [random_op(rng, self.ref.offset, self.max_size, **limits)])

    def run(self, rng, script):
        for op, n in script:
            if op == "prefill":
                self.update(rng, n)
                self.check()
            elif op == "decode":
                for _ in range(n):
                    self.update(rng, 1)
                    self.check()
            else:
                self.trim(n)
                self.check()


# (max_size, keep, longest prefill chunk, longest decode run, ops)
ROTATING = [
    (8, 0, 12, 20, 20),
    (16, 4, 20, 40, 20),
    (33, 0, 40, 50, 20),
    (64, 3, 70, 80, 20),
    (5, 4, 6, 12, 20),  # keep = max_size - 1: a one-slot ring
]


@pytest.mark.parametrize("max_size,keep,chunk_max,decode_max,n_ops", ROTATING)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rotating_matches_mlx_lm(rng, max_size, keep, chunk_max, decode_max, n_ops, dtype):
    gs, bits = QUANT[(max_size + keep) % len(QUANT)]
    seen = set()
    for _ in range(3):  # episodes: each fills a fresh ring, then wraps it
        pair = Pair(
            mlxq.RotatingKVCache(max_size, keep),
            lm.RotatingKVCache(max_size, keep),
            mlxq.RotatingQuantizedKVCache(max_size, keep, group_size=gs, bits=bits),
            dtype,
            gs,
            bits,
        )
        # A trim while filling and, at the end, a wrap, a reorder and a refused
        # trim happen for sure; the random middle mixes everything.
        pair.run(rng, [("prefill", 2), ("trim", 1)])
        pair.run_random(rng, n_ops, chunk_max=chunk_max, decode_max=decode_max)
        pair.run(rng, [("decode", max_size + 1), ("prefill", 3), ("trim", 2)])
        seen |= pair.seen
    assert {"wrap", "reorder", "trim", "refused"} <= seen, seen


def test_rotating_grows_past_one_step(rng):
    """max_size > 256: the buffer grows 256 then 44 rows before the ring wraps."""
    pair = Pair(
        mlxq.RotatingKVCache(300, 2),
        lm.RotatingKVCache(300, 2),
        mlxq.RotatingQuantizedKVCache(300, 2, group_size=64, bits=4),
        mx.float32,
        64,
        4,
    )
    pair.run(
        rng,
        [
            ("prefill", 100),
            ("decode", 250),
            ("trim", 5),
            ("decode", 40),
            ("prefill", 9),
            ("decode", 10),
        ],
    )


@pytest.mark.parametrize("gs,bits", QUANT[:3])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kv_cache_matches_mlx_lm(rng, gs, bits, dtype):
    pair = Pair(mlxq.KVCache(), lm.KVCache(), mlxq.QuantizedKVCache(gs, bits), dtype, gs, bits)
    script = random_script(rng, 25, chunk_max=300, decode_max=30, trim_max=40)
    pair.run(rng, script)
    # The whole state (buffer padding included) matches, as save/load needs.
    assert_same(pair.ours.state[:2], pair.ref.state[:2], "state")


def test_quantized_kv_cache_matches_mlx_lm(rng):
    """The triples themselves, buffer padding included, equal mlx-lm's QuantizedKVCache."""
    ours, ref = mlxq.QuantizedKVCache(64, 4), lm.QuantizedKVCache(64, 4)
    for T in [3, 1, 1, 254, 1, 300, 1]:
        k, v = kv(rng, T, dtype=mx.float16)
        assert_same(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v), f"T={T}")
        assert_same(masks_of(ours), masks_of(ref), "masks")
    assert_same(ours.state, ref.state, "state")
    assert ours.nbytes == ref.nbytes and ours.offset == ref.offset == 561


def test_kv_cache_grows_like_mlx_lm(rng):
    ours, ref = mlxq.KVCache(), lm.KVCache()
    for T, trim in [(255, 0), (1, 0), (1, 3), (700, 0), (1, 0), (2, 10)]:
        k, v = kv(rng, T)
        assert_same(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v))
        assert ours.keys.shape == ref.keys.shape
        assert ours.trim(trim) == ref.trim(trim)


# --- protocol -------------------------------------------------------------------


def test_empty_caches():
    for cache in [
        mlxq.KVCache(),
        mlxq.QuantizedKVCache(),
        mlxq.RotatingKVCache(4),
        mlxq.RotatingQuantizedKVCache(4),
    ]:
        assert cache.empty() and cache.offset == 0 and cache.nbytes == 0 and cache.size() == 0
        assert cache.make_mask(1) is None and cache.make_mask(3) == "causal"
        with pytest.raises(ValueError, match="empty"):
            cache.keys_and_values()


def test_sizes_and_bits(rng):
    q = mlxq.QuantizedKVCache(group_size=32, bits=4)
    r = mlxq.RotatingQuantizedKVCache(8, keep=1, group_size=128, bits=6)
    assert (q.group_size, q.bits, r.group_size, r.bits) == (32, 4, 128, 6)
    for c in (q, r):
        c.update_and_fetch(*kv(rng, 12))
        assert not c.empty()
    assert q.size() == 12 and r.size() == 8
    # 256 rows of 128 values at 4 bits + fp32 scales/biases per 32.
    assert q.nbytes == 2 * 2 * 256 * (128 // 8 * 4 + 2 * 4 * 4)


def test_to_quantized(rng):
    plain = mlxq.KVCache()
    plain.update_and_fetch(*kv(rng, 40))
    q = plain.to_quantized(group_size=32, bits=8)
    assert isinstance(q, mlxq.QuantizedKVCache) and (q.group_size, q.bits, q.offset) == (32, 8, 40)
    assert_same(q.keys_and_values()[0], quantize(plain.keys_and_values()[0], 32, 8))
    assert q.to_quantized(group_size=32, bits=8) is q
    with pytest.raises(ValueError, match="cannot requantize"):
        q.to_quantized(group_size=64, bits=4)

    ring, ref = mlxq.RotatingKVCache(16, keep=2), lm.RotatingKVCache(16, keep=2)
    for T in [10, 1, 1, 1, 1, 1, 1, 1, 4, 1]:  # wraps and reorders
        k, v = kv(rng, T)
        ring.update_and_fetch(k, v)
        ref.update_and_fetch(k, v)
    with pytest.raises(NotImplementedError):
        ref.to_quantized()  # mlx-lm's limitation that mlxq lifts
    qring = ring.to_quantized(group_size=64, bits=4)
    assert isinstance(qring, mlxq.RotatingQuantizedKVCache)
    assert (qring.offset, qring.ring_index, qring.keep, qring.max_size) == (
        ring.offset,
        ring.ring_index,
        2,
        16,
    )
    for T in [1, 1, 3, 1]:  # keeps running in lockstep with the plain ring
        k, v = kv(rng, T)
        got = ring.update_and_fetch(k, v)
        assert_same(qring.update_and_fetch(k, v), tuple(quantize(x, 64, 4) for x in got))
    assert qring.to_quantized(64, 4) is qring


def test_fetch_is_a_view_of_the_buffer(rng):
    """The fetch is the buffer up to offset, not a copy (the same data)."""
    cache = mlxq.KVCache()
    k, v = kv(rng, 10)
    fk, fv = cache.update_and_fetch(k, v)
    assert fk.shape == (1, 2, 10, 128) and cache.keys.shape == (1, 2, 256, 128)
    assert_same(fk, k) and assert_same(fv, v)
    assert_same(cache.keys[..., :10, :], fk)


# --- the seed's extras ------------------------------------------------------------


@pytest.mark.parametrize("max_size,keep", [(8, 0), (12, 3), (6, 5)])
@pytest.mark.parametrize("quantized", [False, True])
def test_temporal_order(rng, max_size, keep, quantized):
    """temporal() is the kept tokens then the newest ones, oldest first."""
    if quantized:
        cache = mlxq.RotatingQuantizedKVCache(max_size, keep, group_size=32, bits=8)
    else:
        cache = mlxq.RotatingKVCache(max_size, keep)
    history, counter = [], 0
    for _ in range(40):
        op, n = random_op(
            rng, cache.offset, max_size, chunk_max=max_size + 3, decode_max=2 * max_size
        )
        if op == "trim":
            if cache.is_trimmable():
                del history[len(history) - cache.trim(n) :]
            continue
        for T in [n] if op == "prefill" else [1] * n:
            ids = mx.arange(counter, counter + T, dtype=mx.float32)  # token ids in the values
            v = mx.broadcast_to(ids[None, None, :, None], (1, 1, T, 32))
            cache.update_and_fetch(v, v)
            history += list(range(counter, counter + T))
            counter += T
            tk, tv = cache.temporal()
            if quantized:
                tv = mx.dequantize(*tv, group_size=32, bits=8)
            got = [int(x) for x in np.array(tv[0, 0, :, 0].astype(mx.float32))]
            held = len(got)
            assert held >= min(len(history), max_size)
            kept = min(keep, held)
            assert got == history[:kept] + history[len(history) - held + kept :]


@pytest.mark.parametrize("kind", ["kv", "quantized", "rotating", "rotating_quantized"])
def test_restore_from_persisted_state(rng, kind):
    make = {
        "kv": lambda: mlxq.KVCache(),
        "quantized": lambda: mlxq.QuantizedKVCache(64, 4),
        "rotating": lambda: mlxq.RotatingKVCache(10, keep=2),
        "rotating_quantized": lambda: mlxq.RotatingQuantizedKVCache(10, 2, 64, 4),
    }[kind]
    cache = make()
    for T in [7, 1, 1, 1, 1, 1, 1, 5, 1, 1]:
        cache.update_and_fetch(*kv(rng, T))
    ring = getattr(cache, "ring_index", None)

    def copy(t):  # what a persisted state reads back: fresh arrays
        return tuple(map(mx.array, t)) if isinstance(t, tuple) else mx.array(t)

    keys, values = copy(cache.keys), copy(cache.values)
    restored = make().restore(keys, values, cache.offset, ring)
    assert restored.offset == cache.offset and getattr(restored, "ring_index", None) == ring
    for T in [1, 1, 4, 1]:
        k, v = kv(rng, T)
        assert_same(restored.update_and_fetch(k, v), cache.update_and_fetch(k, v))
        assert_same(restored.make_mask(3), cache.make_mask(3))


@pytest.mark.parametrize("quantized", [False, True])
def test_kv_sharing(rng, quantized):
    """A donor's fetch, handed to a sharer layer, attends like the donor's own K/V."""
    donor = mlxq.QuantizedKVCache(64, 4) if quantized else mlxq.KVCache()
    donor.update_and_fetch(*kv(rng, 20))
    shared = donor.update_and_share(*kv(rng, 3))
    assert shared.offset == 23 and shared.quantized == quantized
    assert (shared.group_size, shared.bits) == ((64, 4) if quantized else (None, None))
    q = mx.array(rng.standard_normal((1, 4, 3, 128), dtype=np.float32))
    mask = donor.make_mask(3)
    out = shared.attend(q, scale=0.1, mask=mask)
    k, v = donor.keys_and_values()
    want = mlxq.sdpa(q, k, v, scale=0.1, mask=mask)
    assert_same(out, want)
    assert_same(mlxq.SharedKV.from_cache(donor).keys, k)


def test_kv_sharing_from_mlx_lm_cache(rng):
    donor = lm.QuantizedKVCache(group_size=32, bits=8)
    k, v = donor.update_and_fetch(*kv(rng, 5))
    shared = mlxq.SharedKV.from_cache(donor, k, v)
    assert (shared.group_size, shared.bits, shared.offset) == (32, 8, 5)


def test_kv_sharing_rejects_bad_input(rng):
    k, v = kv(rng, 4)
    qk = quantize(k, 64, 4)
    with pytest.raises(ValueError, match="both be arrays or both be triples"):
        mlxq.SharedKV(qk, v, 4, 64, 4)
    with pytest.raises(ValueError, match="need group_size and bits"):
        mlxq.SharedKV(qk, quantize(v, 64, 4), 4)
    with pytest.raises(ValueError, match="not a triple of bits=8"):
        mlxq.SharedKV(qk, quantize(v, 64, 4), 4, 64, 8)
    with pytest.raises(ValueError, match="only for quantized"):
        mlxq.SharedKV(k, v, 4, 64, 4)
    with pytest.raises(ValueError, match=r"agree on \[B, H, N\]"):
        mlxq.SharedKV(k, v[..., :3, :], 4)
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        mlxq.SharedKV(k, v, -1)


# --- attention over every cache's fetch -------------------------------------------


@pytest.mark.parametrize("kind", ["kv", "quantized", "rotating", "rotating_quantized"])
def test_sdpa_takes_every_fetch(rng, kind):
    from support.helpers import assert_close
    from support.reference64 import sdpa64

    cache = {
        "kv": lambda: mlxq.KVCache(),
        "quantized": lambda: mlxq.QuantizedKVCache(64, 8),
        "rotating": lambda: mlxq.RotatingKVCache(32, keep=4),
        "rotating_quantized": lambda: mlxq.RotatingQuantizedKVCache(32, 4, 64, 8),
    }[kind]()
    for T in [40, 1, 1, 3]:
        k, v = kv(rng, T, dtype=mx.float16)
        mask = cache.make_mask(T)  # as a model asks: before the update
        keys, values = cache.update_and_fetch(k, v)
        q = mx.array(rng.standard_normal((1, 4, T, 128), dtype=np.float32)).astype(mx.float16)
        out = mlxq.sdpa(q, keys, values, scale=128**-0.5, mask=mask)
        if isinstance(keys, tuple):
            ref = sdpa64(q, keys, values, scale=128**-0.5, mask=mask, group_size=64, bits=8)
            assert_close(out, ref, dtype=mx.float16)
        else:
            want = mx.fast.scaled_dot_product_attention(
                q, mx.contiguous(keys), mx.contiguous(values), scale=128**-0.5, mask=mask
            )
            assert mx.allclose(out, want, atol=1e-3).item()


def test_quantized_fetch_is_read_in_place(rng):
    """The quantized cache's fetch (a strided view) reaches the kernel uncopied."""
    cache = mlxq.QuantizedKVCache(64, 8)
    k, v = kv(rng, 3000, H=8)
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    del k, v
    view_bytes = sum(x.nbytes for x in keys + values)
    q = mx.array(rng.standard_normal((1, 32, 1, 128), dtype=np.float32))
    mx.eval(q)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = mlxq.sdpa(q, keys, values, scale=128**-0.5)
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    assert extra < view_bytes // 16, f"{extra} bytes allocated for a {view_bytes}-byte view"


# --- bad input --------------------------------------------------------------------


def test_bad_construction():
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        mlxq.QuantizedKVCache(64, 7)
    with pytest.raises(ValueError, match="group_size must be one of .* got 16"):
        mlxq.RotatingQuantizedKVCache(8, 0, 16, 4)
    with pytest.raises(ValueError, match="max_size must be >= 1, got 0"):
        mlxq.RotatingKVCache(0)
    with pytest.raises(ValueError, match=r"keep \(8\) must be < max_size \(8\)"):
        mlxq.RotatingKVCache(8, keep=8)
    with pytest.raises(ValueError, match="keep must be >= 0"):
        mlxq.RotatingKVCache(8, keep=-1)
    with pytest.raises(ValueError, match="max_size must be an int"):
        mlxq.RotatingKVCache(8.5)


@pytest.mark.parametrize(
    "make",
    [
        mlxq.KVCache,
        lambda: mlxq.QuantizedKVCache(64, 4),
        lambda: mlxq.RotatingKVCache(8),
        lambda: mlxq.RotatingQuantizedKVCache(8, 0, 64, 4),
    ],
)
def test_bad_updates(rng, make):
    cache = make()
    k, v = kv(rng, 2)
    with pytest.raises(
        ValueError, match=r"keys must be a 4-D array \[B, H, T, D\], got \(2, 2, 128"
    ):
        cache.update_and_fetch(k[0], v)
    with pytest.raises(ValueError, match=r"values must be a 4-D array .* got list"):
        cache.update_and_fetch(k, [1, 2])
    with pytest.raises(ValueError, match=r"must agree on \[B, H, T\]"):
        cache.update_and_fetch(k, v[:, :1])
    with pytest.raises(ValueError, match="at least one token"):
        cache.update_and_fetch(k[..., :0, :], v[..., :0, :])
    cache.update_and_fetch(k, v)
    with pytest.raises(ValueError, match=r"do not fit the cache's \[B=1, H=2, \*, D=128\]"):
        cache.update_and_fetch(*kv(rng, 1, H=3))
    with pytest.raises(ValueError, match="dtype float16 do not fit the cache.* float32 buffer"):
        cache.update_and_fetch(*kv(rng, 1, dtype=mx.float16))
    with pytest.raises(ValueError, match="D=128"):
        cache.update_and_fetch(*kv(rng, 1, D=64))
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.trim(-1)
    assert cache.offset == 2  # nothing above changed the cache


def test_quantized_needs_whole_groups(rng):
    with pytest.raises(ValueError, match="head dim 96 is not a multiple of group_size 64"):
        mlxq.QuantizedKVCache(64, 4).update_and_fetch(*kv(rng, 1, D=96))
    with pytest.raises(ValueError, match="floating point"):
        mlxq.QuantizedKVCache(64, 4).update_and_fetch(
            mx.zeros((1, 1, 1, 64), mx.int32), mx.zeros((1, 1, 1, 64), mx.int32)
        )


def test_trim_refused_once_the_ring_is_full(rng):
    cache = mlxq.RotatingKVCache(4)
    cache.update_and_fetch(*kv(rng, 3))
    assert cache.trim(2) == 2 and cache.offset == 1
    cache.update_and_fetch(*kv(rng, 3))
    assert not cache.is_trimmable()
    with pytest.raises(
        ValueError, match=r"cannot trim 1 tokens: the ring is full \(offset 4 >= max"
    ):
        cache.trim(1)
    assert cache.trim(0) == 0 and cache.offset == 4


def test_bad_restore_and_state(rng):
    k, v = kv(rng, 8)
    with pytest.raises(ValueError, match=r"offset 9 is outside \[0, 8\]"):
        mlxq.KVCache().restore(k, v, 9)
    with pytest.raises(
        ValueError, match=r"ring index 9 must lie in \[0, min\(buffer rows 8, offset 12"
    ):
        mlxq.RotatingKVCache(8).restore(k, v, 12, 9)
    with pytest.raises(ValueError, match="both be given or both be None"):
        mlxq.KVCache().restore(k, None, 0)
    with pytest.raises(ValueError, match=r"agree on \[B, H, S\]"):
        mlxq.KVCache().restore(k, v[..., :4, :], 4)
    with pytest.raises(ValueError, match="not a triple of bits=4, group_size=64"):
        mlxq.QuantizedKVCache(64, 4).restore(quantize(k, 64, 8), quantize(v, 64, 8), 8)
    with pytest.raises(ValueError, match=r"keys must be a \(packed, scales, biases\) triple"):
        mlxq.QuantizedKVCache(64, 4).restore(k, v, 8)
    with pytest.raises(ValueError, match=r"state must be \(keys, values, offset\), got 2 entries"):
        mlxq.KVCache.from_state((k, v))
    with pytest.raises(ValueError, match="offset must be an int"):
        mlxq.KVCache.from_state((k, v, "8"))


@pytest.mark.parametrize("kind", ["kv", "quantized", "rotating", "rotating_quantized"])
def test_decode_step_writes_in_place(rng, kind):
    """A one-token step allocates about one row, not a copy of the buffer."""
    cache = {
        "kv": lambda: mlxq.KVCache(),
        "quantized": lambda: mlxq.QuantizedKVCache(64, 8),
        "rotating": lambda: mlxq.RotatingKVCache(2048, keep=4),
        "rotating_quantized": lambda: mlxq.RotatingQuantizedKVCache(2048, 4, 64, 8),
    }[kind]()
    fetched = cache.update_and_fetch(*kv(rng, 2000, H=8))
    for _ in range(60):  # into the ring's steady state (and past a wrap)
        fetched = cache.update_and_fetch(*kv(rng, 1, H=8))
    mx.eval(fetched)
    del fetched  # a model drops its fetch after attention; the buffer is then donatable
    for _ in range(3):
        k, v = kv(rng, 1, H=8)
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(cache.update_and_fetch(k, v))
        extra = max(mx.get_peak_memory(), before) - before
        assert extra < cache.nbytes // 64, f"{extra} bytes for a token ({cache.nbytes}-byte cache)"
