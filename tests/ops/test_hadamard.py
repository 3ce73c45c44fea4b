"""Rotated K/V (mlxq.hadamard): quantized in a Walsh-Hadamard basis, attended
as the unrotated keys and values.

The oracle (reference64.sdpa64 with ``rotated``) dequantizes the stored rows
in float64 and rotates them back with the exact Hadamard matrix, so the
reference is the attention over unrotated K/V; queries are given unrotated.
The kernel's result must meet the usual tolerance of the query's dtype.
"""

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import DTYPES, assert_close
from support.reference64 import sdpa64

import mlxq
from mlxq.cache import QuantizedKVCache, RotatingQuantizedKVCache
from mlxq.guard import parts
from mlxq.hadamard import quantize as rotated_triple
from mlxq.hadamard import transform as rotate
from mlxq.kv_format import FormattedTriple, KVFormat, is_hadamard
from mlxq.prompt_cache import load_prompt_cache, save_prompt_cache

CASES = [
    # D, bits, group, q dtype, Hq, Hkv, L, N, mask, sinks, which (K, V) are rotated
    (64, 4, 64, "f32", 8, 2, 1, 300, None, False, (True, True)),
    (64, 2, 32, "bf16", 4, 4, 20, 70, "causal", True, (True, True)),
    (128, 3, 128, "f16", 8, 2, 1, 1000, None, True, (True, True)),
    (128, 4, 32, "bf16", 32, 8, 40, 256, "causal", False, (True, False)),
    (128, 8, 64, "f32", 8, 1, 5, 129, "causal", False, (False, True)),
    (256, 5, 64, "bf16", 8, 1, 1, 777, None, False, (True, True)),
    (256, 6, 128, "f16", 4, 2, 33, 100, "causal", True, (True, True)),
    (512, 4, 64, "bf16", 8, 1, 1, 600, None, False, (True, True)),
    (512, 8, 32, "f32", 8, 1, 17, 64, "causal", False, (True, True)),
]


@pytest.mark.parametrize("D,bits,gs,q_dtype,Hq,Hkv,L,N,mask,with_sinks,which", CASES)
def test_rotated_attention_matches_the_unrotated_oracle(
    rng, D, bits, gs, q_dtype, Hq, Hkv, L, N, mask, with_sinks, which
):
    qd = DTYPES[q_dtype]
    q = mx.array(rng.standard_normal((1, Hq, L, D), dtype=np.float32)).astype(qd)
    kv = [mx.array(rng.standard_normal((1, Hkv, N, D), dtype=np.float32)) for _ in range(2)]
    k, v = (
        rotated_triple(x, gs, bits) if rot else tuple(mx.quantize(x, group_size=gs, bits=bits))
        for x, rot in zip(kv, which)
    )
    sinks = mx.array(rng.normal(0.5, 1.0, Hq).astype(np.float32)) if with_sinks else None
    out = mlxq.sdpa(q, k, v, scale=D**-0.5, mask=mask, sinks=sinks)
    ref = sdpa64(
        q, k, v, scale=D**-0.5, mask=mask, sinks=sinks, group_size=gs, bits=bits, rotated=which
    )
    assert_close(out, ref, dtype=qd)


def test_rotation_lowers_the_error_of_keys_with_outlier_channels(rng):
    # What it is for: a few large channels set every group's scale. The keys
    # are 4-bit; the values 8-bit, so their own error does not dilute the
    # keys'; 16 query rows per head average out single unlucky rows. Over 40
    # seeds the rotated error was 0.46-0.67x the plain one.
    D, N = 128, 512
    k = rng.standard_normal((1, 2, N, D)).astype(np.float32)
    k[..., [3, 70]] *= 30.0
    q = mx.array(rng.standard_normal((1, 8, 16, D), dtype=np.float32))
    k, v = mx.array(k), mx.array(rng.standard_normal((1, 2, N, D), dtype=np.float32))
    exact = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5))
    fmt = dict(bits=4, group_size=64, v_bits=8, v_group_size=64)

    def error(rotated):
        enc = (
            rotated_triple
            if rotated
            else lambda x, g, b: tuple(mx.quantize(x, group_size=g, bits=b))
        )
        out = mlxq.sdpa(q, enc(k, 64, 4), enc(v, 64, 8), scale=D**-0.5, **fmt)
        return np.linalg.norm(np.array(out) - exact) / np.linalg.norm(exact)

    assert error(True) < 0.75 * error(False)


# --------------------------------------------------------------------- caches
def steps(rng, D=128, Hkv=2, lengths=(37, 1, 1, 5, 1)):
    for T in lengths:
        yield tuple(
            mx.array(rng.standard_normal((1, Hkv, T, D), dtype=np.float32)).astype(mx.bfloat16)
            for _ in range(2)
        )


@pytest.mark.parametrize("ring", [False, True])
def test_rotated_cache_holds_quantize_of_the_rotated_rows(rng, ring):
    make = (
        (lambda: RotatingQuantizedKVCache(32, 4, 64, 4, hadamard=True))
        if ring
        else (lambda: QuantizedKVCache(64, 4, hadamard=True))
    )
    cache, plain = make(), mlxq.RotatingKVCache(32, 4) if ring else mlxq.KVCache()
    for k, v in steps(rng):  # 45 tokens: the ring wraps
        got = cache.update_and_fetch(k, v)
        want = plain.update_and_fetch(rotate(k), rotate(v))
        for g, w in zip(got, want):
            assert is_hadamard(g)
            expected = mx.quantize(w, group_size=64, bits=4)
            for a, b in zip(parts(g), expected):
                assert mx.array_equal(a, b)
    assert cache.hadamard and is_hadamard(cache.temporal()[0]) if ring else True


def test_rotated_state_round_trips_and_records_rotation(rng, tmp_path):
    cache = QuantizedKVCache(64, 4, hadamard=True)
    plain = QuantizedKVCache(64, 4)
    for k, v in steps(rng):
        cache.update_and_fetch(k, v)
        plain.update_and_fetch(k, v)
    assert len(cache.state) == len(plain.state) + 1 and cache.state[-1] == 1
    assert cache.meta_state == plain.meta_state + ("1",)
    again = QuantizedKVCache.from_state(cache.state)
    assert again.hadamard and is_hadamard(again.keys_and_values()[0])
    assert not QuantizedKVCache.from_state(plain.state).hadamard
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [cache, plain])
    loaded = load_prompt_cache(path)
    assert [c.hadamard for c in loaded] == [True, False]
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    for a, b in zip(loaded, (cache, plain)):
        assert mx.array_equal(
            mlxq.sdpa(q, *a.keys_and_values(), scale=0.1),
            mlxq.sdpa(q, *b.keys_and_values(), scale=0.1),
        )
    ring = RotatingQuantizedKVCache(16, 0, 32, 8, hadamard=True)
    ring.update_and_fetch(*next(steps(rng)))
    assert RotatingQuantizedKVCache.from_state(ring.state).hadamard


def test_to_quantized_rotates_the_whole_buffer(rng):
    k, v = next(steps(rng))
    plain = mlxq.KVCache()
    plain.update_and_fetch(k, v)
    cache = plain.to_quantized(group_size=64, bits=8, hadamard=True)
    assert cache.hadamard
    want = mx.quantize(rotate(k), group_size=64, bits=8)
    for a, b in zip(parts(cache.keys_and_values()[0]), want):
        assert mx.array_equal(a, b)
    assert cache.to_quantized(64, 8, hadamard=True) is cache
    with pytest.raises(ValueError, match="hadamard"):
        cache.to_quantized(64, 8)


def test_bad_rotation_inputs_raise_clear_errors(rng):
    with pytest.raises(ValueError, match="hadamard must be a bool"):
        QuantizedKVCache(64, 4, hadamard=1)
    cache = QuantizedKVCache(32, 4, hadamard=True)
    x = mx.zeros((1, 1, 2, 96))
    with pytest.raises(ValueError, match="power of two, got 96"):
        cache.update_and_fetch(x, x)
    state = list(QuantizedKVCache(64, 4, hadamard=True).state)
    state[-1] = 2
    with pytest.raises(ValueError, match=r"hadamard entry must be one of \(1,\)"):
        QuantizedKVCache.from_state(state)
    q = mx.zeros((1, 1, 1, 96))
    k = FormattedTriple(
        mx.quantize(mx.zeros((1, 1, 4, 96)), group_size=32, bits=4), KVFormat(32, 4, hadamard=True)
    )
    with pytest.raises(ValueError, match="power of two"):
        mlxq.sdpa(q, k, k, scale=1.0)


def test_the_old_names_still_work_and_warn(rng):
    k, v = next(steps(rng))
    with pytest.warns(DeprecationWarning, match="kv_rotate is deprecated"):
        cache = QuantizedKVCache(64, 4, kv_rotate=True)
    assert cache.hadamard and cache.kv_rotate
    with pytest.warns(DeprecationWarning, match="keep_recent is deprecated"):
        ring = RotatingQuantizedKVCache(32, 0, 64, 4, keep_recent=8)
    assert ring.recent == 8
    with pytest.warns(DeprecationWarning):
        again = mlxq.KVCache().to_quantized(64, 4, kv_rotate=True, keep_recent=4)
    assert again.hadamard and again.recent == 4
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        QuantizedKVCache(64, 4, hadamard=False, recent=3, keep_recent=5)
