"""The batch caches in lockstep with mlx-lm's, over random scripts.

Each script drives mlxq's ``BatchQuantizedKVCache`` (or
``BatchRotatingQuantizedKVCache``) and mlx-lm's ``BatchKVCache`` (or
``BatchRotatingKVCache``) with the same calls and the same random K/V:
batches made three ways (left-padded prompts, right-padded prompts
prefilled in chunks then finalized, single caches merged), one-token
decode steps, longer chunks on a cache with history, sequences leaving
(``filter``), batches joining (``extend``), sequences extracted (and merged
back), trims. After every call, mlxq's buffers must equal ``mx.quantize``
of mlx-lm's (padding included), its offsets, left padding and ring state
must equal mlx-lm's, and so must every fetch and mask.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm
from support.helpers import assert_close, assert_cuda_kernel
from support.reference64 import sdpa64

import mlxq
from mlxq.guard import parts

H, D = 2, 128
FORMATS = [(64, 4), (32, 8), (64, 3), (128, 2)]


class Script:
    """Random calls on a pair (mlxq's cache, mlx-lm's), checked after each."""

    def __init__(self, seed, group_size, bits, dtype, rotating, max_size=11, hadamard=False):
        self.rng = np.random.default_rng(seed)
        self.q = dict(group_size=group_size, bits=bits)
        # mlxq's caches quantize rows in the Hadamard basis (mlx-lm's stay plain).
        self.hadamard = hadamard
        self.pending = []  # extracted caches whose check waits for a later step
        self.dtype = dtype
        self.rotating = rotating
        self.max_size = max_size
        self.smaller = True  # mlxq's cache is smaller than mlx-lm's

    # ------------------------------------------------------------ inputs
    def kv(self, B, T):
        shape = (B, H, T, D)
        k = self.rng.standard_normal(shape).astype(np.float32)
        v = self.rng.standard_normal(shape).astype(np.float32)
        return mx.array(k).astype(self.dtype), mx.array(v).astype(self.dtype)

    @property
    def ours_q(self):
        return dict(self.q, hadamard=self.hadamard)

    def empty_pair(self, left_padding):
        if self.rotating:
            ours = mlxq.BatchRotatingQuantizedKVCache(self.max_size, left_padding, **self.ours_q)
            theirs = lm.BatchRotatingKVCache(self.max_size, left_padding)
        else:
            ours = mlxq.BatchQuantizedKVCache(left_padding, **self.ours_q)
            theirs = lm.BatchKVCache(left_padding)
            ours.step = theirs.step = 16  # grow often
        return ours, theirs

    def single_pair(self, n):
        """A single sequence's caches with ``n`` tokens (mlxq's quantized, mlx-lm's bf16)."""
        if self.rotating:
            ours = mlxq.RotatingQuantizedKVCache(self.max_size, 0, **self.ours_q)
            theirs = lm.RotatingKVCache(self.max_size)
        elif not self.hadamard and self.rng.random() < 0.3:
            ours = lm.QuantizedKVCache(**self.q)  # mlx-lm's own quantized cache batches too
            theirs = lm.KVCache()
        else:
            ours = mlxq.QuantizedKVCache(**self.ours_q)
            theirs = lm.KVCache()
        done = 0
        while done < n:
            T = 1 if self.rng.random() < 0.5 else int(self.rng.integers(1, n - done + 1))
            k, v = self.kv(1, T)
            ours.update_and_fetch(k, v)
            theirs.update_and_fetch(k, v)
            done += T
        return ours, theirs

    def new_batch(self, B):
        how = self.rng.choice(["left", "right", "merge", "merge-plain"])
        if how == "left":
            pad = [int(x) for x in self.rng.integers(0, 6, B)]
            pair = self.empty_pair(pad)
            # A left-padded prompt: its padding, then at least one token.
            self.step(pair, max(pad) + int(self.rng.integers(1, 10)))
        elif how == "right":
            pair = self.empty_pair([0] * B)
            lengths = [int(x) for x in self.rng.integers(2, 20, B)]
            longest = max(lengths)
            for c in pair:
                c.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
            done = 0
            while done < longest:
                # Chunks of >= 2 tokens (a one-token step is a decode step,
                # which needs finalize first), as a padded prefill has.
                T = int(self.rng.integers(min(2, longest), longest - done + 1))
                if longest - done - T == 1:
                    T += 1
                self.step(pair, T)
                done += T
            for c in pair:
                c.finalize()
        else:
            singles = [self.single_pair(int(self.rng.integers(0, 25))) for _ in range(B)]
            ours_in = [s[0] if how == "merge" else s[1] for s in singles]
            if how == "merge-plain" and all(c.keys is None for c in ours_in):
                ours_in = [s[0] for s in singles]  # nothing quantized to take the format from
            kind = (
                mlxq.BatchRotatingQuantizedKVCache if self.rotating else mlxq.BatchQuantizedKVCache
            )
            if how == "merge-plain" and not any(hasattr(c, "bits") for c in ours_in):
                ours_in[0] = singles[0][0]
            if not any(isinstance(c, mlxq.cache.BaseCache) for c in ours_in):
                ours_in[0] = mlxq.QuantizedKVCache(**self.ours_q)  # fixes the quantization
                ours_in[0].update_and_fetch(*self.kv_like(singles[0][1]))
            pair = (kind.merge(ours_in), type(singles[0][1]).merge([s[1] for s in singles]))
            if not self.rotating:
                pair[0].step = pair[1].step = 16
        self.check(pair)
        return pair

    # ------------------------------------------------------------- calls
    def step(self, pair, T):
        ours, theirs = pair
        k, v = self.kv(theirs.offset.shape[0], T)
        mask_args = (
            dict(window_size=int(self.rng.integers(3, 9))) if self.rng.random() < 0.3 else {}
        )
        ours_mask, their_mask = ours.make_mask(T, **mask_args), theirs.make_mask(T, **mask_args)
        assert ours_mask.dtype == mx.bool_
        assert mx.array_equal(ours_mask, their_mask).item(), (ours_mask, their_mask)
        got = ours.update_and_fetch(k, v)
        want = theirs.update_and_fetch(k, v)
        for g, w in zip(got, want):
            self.assert_quantized(g, w)
        self.check(pair)

    def check(self, pair):
        ours, theirs = pair
        assert ours._idx == theirs._idx
        assert np.array_equal(np.array(ours.offset), np.array(theirs.offset))
        assert np.array_equal(np.array(ours.left_padding), np.array(theirs.left_padding))
        assert ours.size() == theirs.size()
        assert ours.empty() == theirs.empty()
        assert ours.is_trimmable() == theirs.is_trimmable()
        if self.rotating:
            assert (ours._offset, ours.rotated) == (theirs._offset, theirs.rotated)
        if theirs.keys is None:
            assert ours.keys is None
            return
        if theirs.offset.shape[0] == 0:
            return
        n = min(theirs._offset, theirs.keys.shape[2]) if self.rotating else theirs._idx
        for o, t in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert o[0].shape[2] == t.shape[2]
            self.assert_quantized(tuple(a[..., :n, :] for a in o), t[..., :n, :])
        if self.smaller:  # (an exact window may outweigh a short quantized buffer)
            assert ours.nbytes < theirs.nbytes

    def kv_like(self, cache):
        """mlx-lm's single cache's content, to fill a fresh cache with."""
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]

    def assert_quantized(self, ours, theirs):
        if theirs.shape[2] == 0:  # (mx.quantize of no rows dies on CUDA)
            assert all(o.shape[2] == 0 for o in parts(ours))
            return
        if self.hadamard:
            theirs = mlxq.hadamard.transform(theirs)
        want = mx.quantize(theirs, **self.q)
        assert len(ours) == 3
        for o, w in zip(parts(ours), want):
            assert o.shape == w.shape and o.dtype == w.dtype
            assert mx.array_equal(o, w).item()

    def extract(self, pair, later=False):
        ours, theirs = pair
        i = int(self.rng.integers(0, theirs.offset.shape[0]))
        mine, stock = ours.extract(i), theirs.extract(i)
        if later:  # unevaluated while the batch writes on: it must not change
            self.pending.append((mine, stock))
            return mine, stock
        self.check_extracted(mine, stock)
        return mine, stock

    def check_extracted(self, mine, stock):
        assert mine.offset == stock.offset
        assert mine.size() == stock.size()
        for o, t in zip(mine.temporal(), (stock.keys, stock.values)):
            n = mine.size()
            self.assert_quantized(tuple(a[..., -n:, :] for a in parts(o)), t[..., -n:, :])

    def run(self, ops=40):
        pair = self.new_batch(int(self.rng.integers(1, 4)))
        for _ in range(ops):
            while self.pending and self.rng.random() < 0.5:
                self.check_extracted(*self.pending.pop(0))
            op = self.rng.choice(["decode"] * 6 + ["chunk", "filter", "extend", "extract", "trim"])
            B = pair[1].offset.shape[0]
            if op == "decode" or (op in ("filter", "extract") and B == 0):
                if B:
                    self.step(pair, 1)
            elif op == "chunk" and B:
                self.step(pair, int(self.rng.integers(2, 8)))
            elif op == "filter":
                keep = sorted(self.rng.choice(B, int(self.rng.integers(1, B + 1)), replace=False))
                for c in pair:
                    c.filter([int(i) for i in keep])
                self.check(pair)
            elif op == "extend" and B < 6:
                other = self.new_batch(int(self.rng.integers(1, 3)))
                pair[0].extend(other[0])
                pair[1].extend(other[1])
                self.check(pair)
            elif op == "extract" and self.rng.random() < 0.5:
                self.extract(pair, later=True)
            elif op == "extract":
                mine, stock = self.extract(pair)
                # ... and back in, merged with a fresh sequence
                fresh = self.single_pair(int(self.rng.integers(1, 9)))
                kind = type(pair[0])
                merged = (kind.merge([mine, fresh[0]]), type(stock).merge([stock, fresh[1]]))
                self.check(merged)
            elif op == "trim" and not self.rotating or (op == "trim" and pair[1].is_trimmable()):
                n = int(self.rng.integers(0, 3))
                assert pair[0].trim(n) == pair[1].trim(n)
                self.check(pair)


@pytest.mark.parametrize("group_size,bits", FORMATS)
@pytest.mark.parametrize("rotating", [False, True], ids=["growing", "rotating"])
@pytest.mark.parametrize("seed", range(3))
def test_lockstep_with_mlx_lm(seed, group_size, bits, rotating):
    Script(seed, group_size, bits, mx.bfloat16, rotating).run()


@pytest.mark.parametrize("rotating", [False, True], ids=["growing", "rotating"])
@pytest.mark.parametrize("seed", range(2))
def test_lockstep_with_rotated_rows(seed, rotating):
    """hadamard: mlxq's rows equal mx.quantize of mlx-lm's rows rotated."""
    Script(20 + seed, 64, 4, mx.bfloat16, rotating, hadamard=True).run()


@pytest.mark.parametrize("rotating", [False, True], ids=["growing", "rotating"])
def test_lockstep_float16_and_a_ring_that_wraps_often(rotating):
    Script(7, 64, 4, mx.float16, rotating, max_size=5).run(ops=60)


def filled(cache, T=5, D=D, H=H, dtype=mx.bfloat16):
    k = mx.random.normal((1, H, T, D)).astype(dtype)
    cache.update_and_fetch(k, k)
    return cache


@pytest.mark.parametrize(
    "others, match",
    [
        ([mlxq.QuantizedKVCache(64, 8)], "different quantization"),
        ([mlxq.QuantizedKVCache(32, 4)], "different quantization"),
        ([mlxq.QuantizedKVCache(64, 4, v_bits=8)], "different quantization"),
        ([mlxq.QuantizedKVCache(64, 4, hadamard=True)], "different quantization"),
    ],
)
def test_merge_refuses_caches_of_different_quantization(others, match):
    with pytest.raises(ValueError, match=match):
        mlxq.BatchQuantizedKVCache.merge([filled(mlxq.QuantizedKVCache(64, 4))] + others)


@pytest.mark.parametrize(
    "other",
    [
        lambda: filled(mlxq.QuantizedKVCache(64, 4), D=64),
        lambda: filled(mlxq.QuantizedKVCache(64, 4), H=4),
        lambda: filled(mlxq.QuantizedKVCache(64, 4), dtype=mx.float16),
        lambda: filled(lm.KVCache(), D=64),
    ],
    ids=["head-dim", "kv-heads", "dtype", "plain-head-dim"],
)
def test_merge_refuses_caches_of_different_shapes(other):
    with pytest.raises(ValueError, match="different"):
        mlxq.BatchQuantizedKVCache.merge([filled(mlxq.QuantizedKVCache(64, 4)), other()])


def test_merge_needs_a_quantized_cache_and_rings_of_one_size():
    with pytest.raises(ValueError, match="none of the caches is quantized"):
        mlxq.BatchQuantizedKVCache.merge([filled(lm.KVCache())])
    rings = [filled(mlxq.RotatingQuantizedKVCache(8, 0, 64, 4)) for _ in range(2)]
    with pytest.raises(ValueError, match="different max_size"):
        mlxq.BatchRotatingQuantizedKVCache.merge(
            rings + [filled(mlxq.RotatingQuantizedKVCache(16, 0, 64, 4))]
        )


def test_bad_batch_input():
    cache = mlxq.BatchQuantizedKVCache([0, 1], group_size=64, bits=4)
    k = mx.zeros((3, H, 1, D))
    with pytest.raises(ValueError, match="3 sequences"):
        cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="left_padding must be >= 0"):
        mlxq.BatchQuantizedKVCache([0, -1])
    with pytest.raises(ValueError, match="bits must be one of"):
        mlxq.BatchQuantizedKVCache([0], bits=7)
    with pytest.raises(ValueError, match="group_size must be one of"):
        mlxq.BatchRotatingQuantizedKVCache(8, [0], group_size=48)
    k = mx.zeros((2, H, 3, D))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="only be added to an empty"):
        cache.prepare(left_padding=[1, 1])
    other = mlxq.BatchQuantizedKVCache([0], group_size=64, bits=8)
    with pytest.raises(ValueError, match="cannot extend"):
        cache.extend(other)
    ring = mlxq.BatchRotatingQuantizedKVCache(8, [0, 0], group_size=64, bits=4)
    ring.prepare(lengths=[2, 3], right_padding=[1, 0])
    ring.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="finalize"):
        ring.update_and_fetch(k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="max_size"):
        ring.extend(mlxq.BatchRotatingQuantizedKVCache(9, [0], group_size=64, bits=4))


def test_state_round_trip_and_copies(tmp_path):
    script = Script(3, 64, 4, mx.bfloat16, rotating=False)
    ours, _ = script.new_batch(3)
    for kind, cache in (
        (mlxq.BatchQuantizedKVCache, ours),
        (mlxq.BatchRotatingQuantizedKVCache, Script(4, 64, 4, mx.bfloat16, True).new_batch(2)[0]),
    ):
        back = kind.from_state(cache.state)  # alone, as mlx-lm restores caches
        assert back.format == cache.format
        path = str(tmp_path / f"{kind.__name__}.safetensors")
        mlxq.save_prompt_cache(path, [cache])
        (loaded,) = mlxq.load_prompt_cache(path)
        assert type(loaded) is kind and loaded._idx == cache._idx
        assert all(mx.array_equal(a, b).item() for a, b in zip(loaded.values, cache.values))
        assert np.array_equal(np.array(back.offset), np.array(cache.offset))
        for a, b in zip(back.keys, cache.keys):
            assert mx.array_equal(a, b).item()
        twin = copy.deepcopy(cache)
        k = mx.ones((cache.batch_size, H, 1, D), mx.bfloat16)
        before = [mx.array(a) for a in cache.keys]
        twin.update_and_fetch(k, k)
        assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys, before))


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rotating", [False, True], ids=["growing", "rotating"])
def test_attention_over_a_padded_batch(bits, group_size, L, dtype, rotating):
    """A batch step's fetch and mask through mlxq.quantized_sdpa, against
    float64: padding and (for a wrapped ring) evicted slots hidden per
    sequence. On CUDA the decode kernel takes the bool mask itself."""
    rng = np.random.default_rng(bits * 10 + L)
    Hq, Hkv, B = 8, 2, 3
    q = dict(group_size=group_size, bits=bits)
    if rotating:
        cache = mlxq.BatchRotatingQuantizedKVCache(64, [5, 0, 37], **q)
    else:
        cache = mlxq.BatchQuantizedKVCache([5, 0, 37], **q)

    def kv(T):
        x = rng.standard_normal((2, B, Hkv, T, D)).astype(np.float32)
        return mx.array(x[0]).astype(dtype), mx.array(x[1]).astype(dtype)

    cache.update_and_fetch(*kv(70))  # the rotating ring wraps in the steps below
    for _ in range(3):
        cache.update_and_fetch(*kv(1))
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(*kv(L))
    queries = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32)).astype(dtype)
    out = mlxq.quantized_sdpa(queries, keys, values, scale=D**-0.5, mask=mask, **q)
    mx.eval(out)
    assert_cuda_kernel("cuda_decode")
    ref = sdpa64(queries, keys, values, scale=D**-0.5, mask=mask, **q)
    assert_close(out, ref, dtype=dtype)


def test_mlxq_unquantized_caches_merge_into_mlx_lms_batch_caches():
    """mlxq's bf16 KVCache / RotatingKVCache batch as mlx-lm's own do."""
    rng = np.random.default_rng(9)
    for ours, theirs in (
        ([mlxq.KVCache() for _ in range(3)], [lm.KVCache() for _ in range(3)]),
        (
            [mlxq.RotatingKVCache(8) for _ in range(3)],
            [lm.RotatingKVCache(8) for _ in range(3)],
        ),
    ):
        for a, b, n in zip(ours, theirs, (3, 11, 6)):
            k = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32))
            a.update_and_fetch(k, k)
            b.update_and_fetch(k, k)
        got, want = ours[0].merge(ours), theirs[0].merge(theirs)
        assert type(got) is type(want)
        assert mx.array_equal(got.keys, want.keys).item()
        assert np.array_equal(np.array(got.left_padding), np.array(want.left_padding))


def test_rings_with_kept_tokens_batch_as_mlx_lms_do():
    """max_kv_size rings (keep=4) batch like mlx-lm's: nothing stays pinned."""
    rng = np.random.default_rng(3)
    ours = [mlxq.RotatingQuantizedKVCache(8, 4, 64, 4) for _ in range(2)]
    theirs = [lm.RotatingKVCache(8, keep=4) for _ in range(2)]
    for a, b, n in zip(ours, theirs, (13, 5)):
        for _ in range(n):
            k = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float32)).astype(mx.bfloat16)
            a.update_and_fetch(k, k)
            b.update_and_fetch(k, k)
    got, want = (
        mlxq.BatchRotatingQuantizedKVCache.merge(ours),
        lm.BatchRotatingKVCache.merge(theirs),
    )
    for o, t in zip(got.keys, mx.quantize(want.keys, group_size=64, bits=4)):
        assert mx.array_equal(o, t).item()
    assert np.array_equal(np.array(got.offset), np.array(want.offset))
