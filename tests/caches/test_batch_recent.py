"""A batch cache's recent window (``BatchQuantizedKVCache(recent=R)``) in
lockstep with mlx-lm's unquantized ``BatchKVCache``, over random scripts.

The scripts of test_batch_caches.py (batches made from left-padded prompts,
right-padded prompts finalized, single caches merged; decode steps, chunks,
filter, extend, extract, trim) run with a window on mlxq's side. After every
update the fetch must split where the window says: the quantized rows equal
``mx.quantize`` of mlx-lm's rows before the split, the exact rows equal
mlx-lm's rows after it bit for bit (padding aside, which the mask hides),
and the split leaves every sequence's last ``R`` tokens exact, except after
a trim (the ring no longer holds what a trim uncovers).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm
from support.helpers import quantize, to_f64
from support.reference64 import dequantize64
from test_batch_caches import Script

import mlxq
from mlxq.split import RecentSplit


def in_order(split: RecentSplit) -> mx.array:
    """A fetch's exact rows oldest first (a decode step's come in ring order)."""
    if split.columns is None:
        return split.exact
    order = np.argsort(np.asarray(split.columns))
    return split.exact[..., mx.array(order), :]


class WindowScript(Script):
    def __init__(self, seed, R, **kw):
        super().__init__(seed, 64, 4, mx.bfloat16, rotating=False, **kw)
        self.R = R
        self.smaller = R < 8
        self.full = True  # every sequence's last R tokens exact (until a trim)

    def empty_pair(self, left_padding):
        ours, theirs = super().empty_pair(left_padding)
        ours = mlxq.BatchQuantizedKVCache(left_padding, **self.ours_q, recent=self.R)
        ours.step = 16
        return ours, theirs

    def single_pair(self, n):
        ours, theirs = mlxq.QuantizedKVCache(**self.ours_q, recent=self.R), lm.KVCache()
        done = 0
        while done < n:
            T = 1 if self.rng.random() < 0.5 else int(self.rng.integers(1, n - done + 1))
            k, v = self.kv(1, T)
            ours.update_and_fetch(k, v)
            theirs.update_and_fetch(k, v)
            done += T
        return ours, theirs

    def step(self, pair, T):
        ours, theirs = pair
        prev = ours._idx
        k, v = self.kv(theirs.offset.shape[0], T)
        mask = ours.make_mask(T) if ours._right_padding is None else None  # (as a model makes it)
        got = ours.update_and_fetch(k, v)
        want = theirs.update_and_fetch(k, v)
        assert all(isinstance(g, RecentSplit) for g in got)
        n = got[0].quantized_length
        if self.full and ours._right_padding is None:
            assert n == max(prev - self.R, 0), (n, prev, self.R)
        lp = np.array(theirs.left_padding)
        for g, w in zip(got, want):
            self.assert_quantized(g.quantized, w[..., :n, :])
            exact = np.array(in_order(g).astype(mx.float32))
            ref = np.array(w[..., n:, :].astype(mx.float32))
            assert exact.shape == ref.shape
            if ours._right_padding is not None:
                continue  # (a right-padded prefill: rows past a prompt are padding)
            for b in range(ref.shape[0]):
                real = max(int(lp[b]) - n, 0)  # the sequence's rows within the exact part
                assert np.array_equal(exact[b, :, real:], ref[b, :, real:]), b
        self.attend(ours, theirs, got, T, mask)
        self.check(pair)

    def attend(self, ours, theirs, got, T, mask):
        """mlxq.sdpa over the split equals float64 attention over mlx-lm's
        rows, those before the split dequantized."""
        if theirs.offset.shape[0] == 0:
            return
        B = theirs.offset.shape[0]
        q = mx.array(self.rng.standard_normal((B, 2 * 2, T, 128)).astype(np.float32))
        q = q.astype(mx.bfloat16)
        if mask is None:
            return
        n = got[0].quantized_length
        out = mlxq.sdpa(q, got[0], got[1], scale=128**-0.5, mask=mask)
        # float64: rows before the split as stored (mx.quantize of mlx-lm's), then exact.
        rows = []
        for t in (theirs.keys, theirs.values):
            t = t[..., : ours._idx, :]
            head = dequantize64(quantize(t[..., :n, :], 64, 4), 64, 4) if n else None
            tail = to_f64(t[..., n:, :])
            rows.append(tail if head is None else np.concatenate([head, tail], axis=2))
        K, V = rows
        q64, vis = to_f64(q), np.array(mask)
        rep = q64.shape[1] // K.shape[1]
        K, V = np.repeat(K, rep, axis=1), np.repeat(V, rep, axis=1)
        s = np.where(vis, np.einsum("bhld,bhnd->bhln", q64, K) * 128**-0.5, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
        den = p.sum(-1, keepdims=True)
        ref = np.einsum("bhln,bhnd->bhld", p, V) / np.where(den > 0, den, 1)
        err = np.abs(to_f64(out) - ref).max(initial=0.0)
        assert err < 2e-2, err

    def run(self, ops=30):
        pair = self.new_batch(int(self.rng.integers(1, 4)))
        for _ in range(ops):
            op = self.rng.choice(["decode"] * 6 + ["chunk", "filter", "extend", "extract", "trim"])
            B = pair[1].offset.shape[0]
            if op in ("decode", "chunk") and B:
                self.step(pair, 1 if op == "decode" else int(self.rng.integers(2, 8)))
            elif op == "filter" and B:
                keep = sorted(self.rng.choice(B, int(self.rng.integers(1, B + 1)), replace=False))
                for c in pair:
                    c.filter([int(i) for i in keep])
                self.check(pair)
            elif op == "extend" and B < 6:
                other = self.new_batch(int(self.rng.integers(1, 3)))
                pair[0].extend(other[0])
                pair[1].extend(other[1])
                self.check(pair)
            elif op == "extract" and B:
                i = int(self.rng.integers(0, B))
                mine, stock = pair[0].extract(i), pair[1].extract(i)
                self.check_extracted(mine, stock)
                self.check_window(mine, stock)
            elif op == "trim":
                n = int(self.rng.integers(0, 3))
                assert pair[0].trim(n) == pair[1].trim(n)
                self.full = self.full and n == 0
                self.check(pair)

    def check_window(self, mine, stock):
        """An extracted sequence keeps its window: its next step reads its
        last R tokens exactly."""
        k, v = self.kv(1, 1)
        got = mine.update_and_fetch(k, v)
        want = stock.update_and_fetch(k, v)
        n = got[0].quantized_length
        if self.full:
            assert n == max(mine.offset - 1 - self.R, 0)
        for g, w in zip(got, want):
            exact = in_order(g)
            assert mx.array_equal(exact, w[..., n : mine.offset, :]).item()


@pytest.mark.parametrize("R", [3, 8, 40])
@pytest.mark.parametrize("seed", range(3))
def test_window_lockstep_with_mlx_lm(seed, R):
    WindowScript(seed, R).run()
