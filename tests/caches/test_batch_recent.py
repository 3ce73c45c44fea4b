"""A batch cache's recent window (``BatchQuantizedKVCache(recent=R)``,
``BatchRotatingQuantizedKVCache(..., recent=R)``) in lockstep with mlx-lm's
unquantized ``BatchKVCache`` / ``BatchRotatingKVCache``, over random scripts.

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


def exact_columns(split: RecentSplit) -> np.ndarray:
    """The fetch columns (mlx-lm's fetch, the mask) of a split's exact rows:
    in order after the quantized rows, or a decode step's ring slots."""
    if split.columns is None:
        n = split.quantized_length
        return np.arange(n, n + split.exact.shape[2])
    return split.exact_columns


class WindowScript(Script):
    def __init__(self, seed, R, rotating=False, max_size=None, **kw):
        max_size = max_size or R + 1 + int(np.random.default_rng(seed).integers(0, 9))
        super().__init__(seed, 64, 4, mx.bfloat16, rotating=rotating, max_size=max_size, **kw)
        self.R = R
        self.smaller = R < 8 and not rotating
        self.full = True  # every sequence's last R tokens exact (until a trim)

    def empty_pair(self, left_padding):
        ours, theirs = super().empty_pair(left_padding)
        if self.rotating:
            ours = mlxq.BatchRotatingQuantizedKVCache(
                self.max_size, left_padding, **self.ours_q, recent=self.R
            )
        else:
            ours = mlxq.BatchQuantizedKVCache(left_padding, **self.ours_q, recent=self.R)
            ours.step = 16
        return ours, theirs

    def single_pair(self, n):
        if self.rotating:
            ours = mlxq.RotatingQuantizedKVCache(self.max_size, 0, **self.ours_q, recent=self.R)
            theirs = lm.RotatingKVCache(self.max_size)
        else:
            ours, theirs = mlxq.QuantizedKVCache(**self.ours_q, recent=self.R), lm.KVCache()
        done = 0
        while done < n:
            T = 1 if self.rng.random() < 0.5 else int(self.rng.integers(1, n - done + 1))
            k, v = self.kv(1, T)
            ours.update_and_fetch(k, v)
            theirs.update_and_fetch(k, v)
            done += T
        return ours, theirs

    def padded(self, ours) -> bool:
        """Whether a right-padded prefill is under way (rows past a prompt are padding)."""
        return getattr(ours, "_right_padding", None) is not None or (
            getattr(ours, "_lengths", None) is not None
        )

    def step(self, pair, T):
        ours, theirs = pair
        prev = ours._offset if self.rotating else ours._idx
        k, v = self.kv(theirs.offset.shape[0], T)
        mask = None if self.padded(ours) else ours.make_mask(T)  # (as a model makes it)
        got = ours.update_and_fetch(k, v)
        want = theirs.update_and_fetch(k, v)
        assert all(isinstance(g, RecentSplit) for g in got)
        n = got[0].quantized_length
        if self.full and mask is not None:
            assert got[0].exact.shape[2] == min(prev, self.R) + T, (prev, self.R, T)
        for g, w in zip(got, want):
            cols = exact_columns(g)
            if g.visible is None:  # rows before the split quantized, the window's not
                self.assert_quantized(g.quantized_rows, w[..., :n, :])
            else:  # the whole ring quantized, the window's slots hidden
                self.assert_quantized(g.quantized_rows, w)
                assert np.array_equal(np.flatnonzero(~np.array(g.visible)), np.sort(cols))
            exact = np.array(g.exact.astype(mx.float32))
            ref = np.array(w[..., mx.array(cols), :].astype(mx.float32))
            assert exact.shape == ref.shape
            if mask is None:
                continue  # (a right-padded prefill: rows past a prompt are padding)
            real = np.array(mask).any(axis=2)[:, 0, cols]  # [B, rows]: a sequence's own
            for b in range(ref.shape[0]):
                assert np.array_equal(exact[b][:, real[b]], ref[b][:, real[b]]), b
        self.attend(got, want, T, mask)
        self.check(pair)

    def attend(self, got, want, T, mask):
        """mlxq.sdpa over the split equals float64 attention over mlx-lm's
        fetch, its rows outside the window as stored (mx.quantize of mlx-lm's)."""
        B = want[0].shape[0]
        if B == 0 or mask is None:
            return
        q = mx.array(self.rng.standard_normal((B, 2 * 2, T, 128)).astype(np.float32))
        q = q.astype(mx.bfloat16)
        out = mlxq.sdpa(q, got[0], got[1], scale=128**-0.5, mask=mask)
        cols = exact_columns(got[0])
        K, V = (
            np.where(
                np.isin(np.arange(w.shape[2]), cols)[None, None, :, None],
                to_f64(w),
                dequantize64(quantize(w, 64, 4), 64, 4),
            )
            for w in want
        )
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
            elif op == "trim" and (not self.rotating or pair[1].is_trimmable()):
                n = int(self.rng.integers(0, 3))
                assert pair[0].trim(n) == pair[1].trim(n)
                self.full = self.full and n == 0
                self.check(pair)

    def check_window(self, mine, stock):
        """An extracted sequence keeps its window: its next step reads its
        last R tokens exactly."""
        prev = mine.offset
        k, v = self.kv(1, 1)
        got = mine.update_and_fetch(k, v)
        want = stock.update_and_fetch(k, v)
        if self.full:
            assert got[0].exact.shape[2] == min(prev, self.R) + 1
        for g, w in zip(got, want):
            assert mx.array_equal(g.exact, w[..., mx.array(exact_columns(g)), :]).item()


@pytest.mark.parametrize("R", [3, 8, 40])
@pytest.mark.parametrize("rotating", [False, True], ids=["growing", "rotating"])
@pytest.mark.parametrize("seed", range(3))
def test_window_lockstep_with_mlx_lm(seed, rotating, R):
    WindowScript(seed, R, rotating).run()
