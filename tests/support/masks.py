"""The attention masks every kernel test draws from: one list of kinds, one
generator. Each kind is an input layout or semantics the kernels must honour
(broadcast shapes, per-head masks, non-contiguous views, additive dtypes,
rows that see no key)."""

import mlx.core as mx
import numpy as np


def make_mask(kind, rng, B, Hq, L, N):
    """A mask of the given kind for [B, Hq, L, N] scores; a few rows fully hidden."""

    def with_neg_inf(shape, dtype):
        a = rng.normal(0, 2, shape).astype(np.float32)
        a[rng.random(shape) < 0.2] = -np.inf
        a[..., 0, :] = -np.inf  # query 0 sees no key: it must output 0
        return mx.array(a).astype(dtype)

    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "bool_LN":
        return mx.array(rng.random((L, N)) < 0.7)
    if kind == "bool_B1LN":
        return mx.array(rng.random((B, 1, L, N)) < 0.7)
    if kind == "bool_BHLN":  # a different mask per query head
        m = rng.random((B, Hq, L, N)) < 0.5
        m[0, 1, L // 2] = False
        return mx.array(m)
    if kind == "bool_keypad":  # [B, 1, 1, N]: padded keys per batch entry
        lengths = rng.integers(1, N + 1, B)
        return mx.array(np.arange(N)[None, None, None, :] < lengths[:, None, None, None])
    if kind == "bool_window":  # sliding window of 16 keys, bottom-right causal
        key, pos = np.arange(N)[None, :], np.arange(L)[:, None] + N - L
        return mx.array((key <= pos) & (key > pos - 16))
    if kind == "bool_transposed":  # a non-contiguous view
        return mx.array(rng.random((N, L)) < 0.6).T
    if kind == "add_f32":
        return with_neg_inf((1, Hq, L, N), mx.float32)
    if kind == "add_bf16":
        return with_neg_inf((L, N), mx.bfloat16)
    if kind == "add_f16":
        return with_neg_inf((B, 1, L, N), mx.float16)
    if kind == "add_row_const":  # broadcast along keys: stride 0 in the last axis
        return mx.array(rng.normal(0, 3, (Hq, L, 1)).astype(np.float32))
    if kind == "add_finfo_min":  # the "masked" fill of HF-style masks, finite
        lowest = np.finfo(np.float32).min
        a = np.where(rng.random((B, 1, L, N)) < 0.3, lowest, 0.0).astype(np.float32)
        a[..., 0, :] = lowest  # every key equally far down: a plain average
        return mx.array(a)
    if kind == "all_hidden":
        return mx.zeros((L, N), dtype=mx.bool_)
    if kind == "all_neg_inf":
        return mx.full((1, 1, 1, N), -np.inf, dtype=mx.float32)
    raise AssertionError(kind)


MASK_KINDS = [
    "none",
    "causal",
    "bool_LN",
    "bool_B1LN",
    "bool_BHLN",
    "bool_keypad",
    "bool_window",
    "bool_transposed",
    "add_f32",
    "add_bf16",
    "add_f16",
    "add_row_const",
    "add_finfo_min",
    "all_hidden",
    "all_neg_inf",
]
