"""Helpers for the cache tests: random K/V, exact comparisons, random scripts."""

import mlx.core as mx
import numpy as np

from mlxq.guard import parts


def kv(rng, T, *, B=1, H=2, D=128, dtype=mx.float32):
    """Random keys and values [B, H, T, D] (values distinct from keys)."""
    k = mx.array(rng.standard_normal((B, H, T, D), dtype=np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, T, D), dtype=np.float32)).astype(dtype)
    mx.eval(k, v)
    return k, v


def fresh(x):
    """A distinct array object with the same contents (mlx-lm assigns into its
    buffers in place, which would also change an array object both caches hold)."""
    return mx.array(x)


def assert_same(a, b, what="value"):
    """Exactly equal: None/str masks by value, arrays and triples bit for bit."""
    if a is None or isinstance(a, (str, int, float)):
        assert a == b, f"{what}: {a!r} != {b!r}"
        return
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {type(b)}"
        for i, (x, y) in enumerate(zip(parts(a), parts(b))):
            assert_same(x, y, f"{what}[{i}]")
        return
    assert isinstance(b, mx.array), f"{what}: expected an array, got {b!r}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert mx.array_equal(a, b).item(), f"{what}: values differ"


def random_script(rng, n_ops, *, chunk_max, decode_max, trim_max=6):
    """A list of ("prefill", T >= 2) | ("decode", n tokens) | ("trim", n) steps."""
    ops = [("prefill", int(rng.integers(2, chunk_max + 1)))] if rng.random() < 0.7 else []
    while len(ops) < n_ops:
        r = rng.random()
        if r < 0.25:
            ops.append(("prefill", int(rng.integers(2, chunk_max + 1))))
        elif r < 0.4:
            ops.append(("trim", int(rng.integers(0, trim_max + 1))))
        else:
            ops.append(("decode", int(rng.integers(1, decode_max + 1))))
    return ops


def random_op(rng, offset, max_size, *, chunk_max, decode_max, trim_max=6):
    """The next step of a random script, chosen from the cache's state: before a
    ring fills up mostly short steps and trims, so trims get exercised; after it,
    mostly decode runs through wrap-arounds and multi-token reorders."""
    filling = max_size is not None and offset < max_size
    r = rng.random()
    if r < (0.3 if filling else 0.1):
        return "trim", int(rng.integers(0, (3 if filling else trim_max) + 1))
    if r < 0.6:
        longest = max(3, max_size // 2) if filling else chunk_max
        return "prefill", int(rng.integers(2, longest + 1))
    return "decode", int(rng.integers(1, (3 if filling else decode_max) + 1))
