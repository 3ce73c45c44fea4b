"""Masks: mlx-lm's causal masks bit for bit, and bidirectional image spans."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache
from support.caches import assert_same

import mlxq


@pytest.mark.parametrize(
    "N,offset,window",
    list(itertools.product([1, 2, 7, 64], [0, 1, 5, 300], [None, 1, 3, 8, 1000])),
)
def test_causal_mask_matches_mlx_lm(N, offset, window):
    got = mlxq.create_causal_mask(N, offset, window_size=window)
    assert_same(got, lm_base.create_causal_mask(N, offset, window_size=window))
    q = np.arange(offset, offset + N)[:, None]
    k = np.arange(offset + N)[None]
    want = (k <= q) & ((q - k < window) if window else True)
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize(
    "N,offset,window,return_array",
    list(itertools.product([1, 4], [0, 9], [None, 2, 20], [False, True])),
)
def test_attention_mask_matches_mlx_lm(N, offset, window, return_array):
    got = mlxq.create_attention_mask(N, offset, return_array, window)
    assert_same(got, lm_cache.create_attention_mask(N, offset, return_array, window))


def np_bidirectional(L, offset, window, group):
    """Reference: causal(+window) or (same nonzero group), over offset + L keys."""
    q = np.arange(offset, offset + L)[:, None]
    k = np.arange(offset + L)[None]
    causal = (k <= q) & ((q - k < window) if window else True)
    together = (group[offset:, None] == group[None, :]) & (group[None, :] > 0)
    return causal | together


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("offset", [0, 3])
def test_bidirectional_bool_vector(window, offset):
    """The seed's form: every marked token sees every other marked token."""
    L = 12
    marked = np.zeros(offset + L, bool)
    marked[[4, 5, 6, 9, 10]] = True
    got = mlxq.bidirectional_mask(L, window, mx.array(marked), offset=offset)
    assert got.dtype == mx.bool_ and got.shape == (L, offset + L)
    assert np.array_equal(np.array(got), np_bidirectional(L, offset, window, marked.astype(int)))
    # A plain list works too.
    assert_same(mlxq.bidirectional_mask(L, window, marked.tolist(), offset=offset), got)


@pytest.mark.parametrize("window", [None, 3])
def test_bidirectional_spans(window):
    """Spans: tokens see the others of their own image only."""
    L, spans = 16, [(2, 6), (9, 14)]
    group = np.zeros(L, int)
    group[2:6], group[9:14] = 1, 2
    got = mlxq.bidirectional_mask(L, window, spans)
    assert np.array_equal(np.array(got), np_bidirectional(L, 0, window, group))
    # Image 1 never sees image 2 in the future; image 2 sees image 1 causally only.
    assert not np.array(got)[3, 10] and np.array(got)[10, 3] == (window is None)
    # No spans: the causal mask.
    assert_same(mlxq.bidirectional_mask(L, window, []), mlxq.create_causal_mask(L, 0, window))


def test_bidirectional_mask_drives_attention(rng):
    """The mask is a valid mlxq.sdpa mask (bool, [L, N])."""
    L = 10
    q, k, v = (mx.array(rng.standard_normal((1, 2, L, 64), dtype=np.float32)) for _ in range(3))
    mask = mlxq.bidirectional_mask(L, None, [(3, 7)])
    out = mlxq.sdpa(q, k, v, scale=0.125, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert mx.allclose(out, want).item()


def test_bad_masks():
    with pytest.raises(ValueError, match="N must be >= 0, got -1"):
        mlxq.create_causal_mask(-1)
    with pytest.raises(ValueError, match="window_size must be >= 1, got 0"):
        mlxq.create_causal_mask(3, 0, window_size=0)
    with pytest.raises(ValueError, match="offset must be an int, got float"):
        mlxq.create_causal_mask(3, 1.5)
    with pytest.raises(ValueError, match=r"length offset \+ L = 6, got shape \(5,\)"):
        mlxq.bidirectional_mask(4, None, [True] * 5, offset=2)
    with pytest.raises(ValueError, match="span \\(3, 9\\) is not within \\[0, 8\\)"):
        mlxq.bidirectional_mask(8, None, [(3, 9)])
    with pytest.raises(ValueError, match="overlaps another span"):
        mlxq.bidirectional_mask(8, None, [(1, 4), (3, 5)])
    with pytest.raises(ValueError, match="must be \\(start, end\\)"):
        mlxq.bidirectional_mask(8, None, [(1, 2, 3)])
