"""Keys and values quantized apart (``v_bits`` / ``v_group_size``): caches,
prompt-cache files, SharedKV, mlx-lm's generation and the CLI.

The kernels' own checks against the float64 oracle for every (K, V) pair
live in tests/ops/test_quantized_sdpa.py (and tests/metal/ for the Metal kernels)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache
from support.caches import assert_same, kv
from support.helpers import assert_close, quantize
from support.lm import (
    CONTINUATION,
    PROMPT_LEN,
    STOCK_CRASHES,
    STOCK_RUNS,
    argmax_agreement,
    runs,
    teacher_forced,
    tokens,
)
from support.reference64 import sdpa64

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.guard import parts
from mlxq.kv_format import FormattedTriple, KVFormat
from mlxq.prompt_cache import load_prompt_cache, save_prompt_cache
from mlxq.random_models import random_model

# (keys' group, bits), (values' group, bits)
PAIRS = [((64, 8), (64, 4)), ((32, 4), (128, 8)), ((64, 6), (32, 3)), ((128, 8), (64, 2))]


def caches(k_fmt, v_fmt, kind, **kw):
    (kg, kb), (vg, vb) = k_fmt, v_fmt
    if kind == "ring":
        return mlxq.RotatingQuantizedKVCache(
            24, 2, kg, kb, v_group_size=vg, v_bits=vb, **kw
        ), mlxq.RotatingKVCache(24, 2)
    return mlxq.QuantizedKVCache(kg, kb, v_group_size=vg, v_bits=vb, **kw), mlxq.KVCache()


@pytest.mark.parametrize("k_fmt,v_fmt", PAIRS)
@pytest.mark.parametrize("kind", ["growing", "ring"])
def test_caches_hold_quantize_of_each_side(rng, k_fmt, v_fmt, kind):
    # In lockstep with the unquantized cache, through growth past 256 rows
    # and ring wrap-around (O(1) in-place decode writes, per side).
    quant, plain = caches(k_fmt, v_fmt, kind)
    for T in [5, 1, 1, 40, 1, 1, 1, 260, 1, 1, 3, 1]:
        k, v = kv(rng, T, B=2, D=128, dtype=mx.bfloat16)
        want = plain.update_and_fetch(k, v)
        got = quant.update_and_fetch(k, v)
        assert_same(got[0], quantize(want[0], *k_fmt), f"keys after T={T}")
        assert_same(got[1], quantize(want[1], *v_fmt), f"values after T={T}")
        assert isinstance(got[1], FormattedTriple) and (got[1].group_size, got[1].bits) == v_fmt
        assert isinstance(got[0], FormattedTriple) and not got[0].values
    q = mx.array(rng.standard_normal((2, 4, 1, 128), dtype=np.float32)).astype(mx.bfloat16)
    out = mlxq.sdpa(q, *got, scale=0.1)  # the values' width from the triple
    ref = sdpa64(
        q,
        got[0],
        got[1],
        scale=0.1,
        group_size=k_fmt[0],
        bits=k_fmt[1],
        v_group_size=v_fmt[0],
        v_bits=v_fmt[1],
    )
    assert_close(out, ref, dtype=mx.bfloat16)
    expected = sum(a.nbytes for a in quantize(want[0], *k_fmt) + quantize(want[1], *v_fmt))
    assert kind == "ring" or quant.nbytes >= expected


def test_decode_writes_stay_in_place(rng):
    cache = mlxq.QuantizedKVCache(64, 8, v_bits=4)
    cache.update_and_fetch(*kv(rng, 20))
    mlxq._ext._take_ring_copies()
    for _ in range(10):
        keys, values = cache.update_and_fetch(*kv(rng, 1))
        mx.eval(parts(keys), parts(values))
    assert mlxq._ext._take_ring_copies() == 0


@pytest.mark.parametrize("rotate", [False, True])
def test_state_and_prompt_cache_files_record_the_values_quantization(rng, tmp_path, rotate):
    pair = mlxq.QuantizedKVCache(64, 8, hadamard=rotate, v_group_size=32, v_bits=4)
    ring = mlxq.RotatingQuantizedKVCache(16, 0, 64, 4, hadamard=rotate, v_bits=2)
    same = mlxq.QuantizedKVCache(64, 4, hadamard=rotate)
    for c in (pair, ring, same):
        for T in (9, 1, 1):
            c.update_and_fetch(*kv(rng, T))
    assert pair.state[-3:] == (int(rotate), 32, 4)
    assert pair.meta_state[-3:] == (str(int(rotate)), "32", "4")
    assert ring.state[-3:] == (int(rotate), 64, 2)
    assert len(same.state) == 5 + rotate  # mlx-lm's own state (+ hadamard=1)
    again = mlxq.QuantizedKVCache.from_state(pair.state)
    assert (again.v_group_size, again.v_bits, again.hadamard) == (32, 4, rotate)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [pair, ring, same])
    loaded = load_prompt_cache(path)
    assert [c.format.side(values=True) for c in loaded] == [(32, 4), (64, 2), (64, 4)]
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    for a, b in zip(loaded, (pair, ring, same)):
        assert mx.array_equal(
            mlxq.sdpa(q, *a.keys_and_values(), scale=0.1),
            mlxq.sdpa(q, *b.keys_and_values(), scale=0.1),
        )
        k, v = kv(rng, 1)
        assert_same(a.update_and_fetch(k, v), b.update_and_fetch(k, v))


def test_to_quantized_and_shared_kv(rng):
    plain = mlxq.KVCache()
    plain.update_and_fetch(*kv(rng, 30))
    cache = plain.to_quantized(64, 8, v_group_size=32, v_bits=4)
    keys, values = plain.keys_and_values()
    assert_same(cache.keys_and_values(), (quantize(keys, 64, 8), quantize(values, 32, 4)))
    assert cache.to_quantized(64, 8, v_group_size=32, v_bits=4) is cache
    with pytest.raises(ValueError, match="cannot requantize"):
        cache.to_quantized(64, 8)
    shared = mlxq.SharedKV.from_cache(cache)
    assert (shared.v_group_size, shared.v_bits) == (32, 4)
    q = mx.random.normal((1, 4, 2, 128))
    assert mx.array_equal(
        shared.attend(q, scale=0.1), mlxq.sdpa(q, *cache.keys_and_values(), scale=0.1)
    )


def test_bad_value_quantization_raises(rng):
    with pytest.raises(ValueError, match="v_bits must be one of"):
        mlxq.QuantizedKVCache(64, 8, v_bits=7)
    with pytest.raises(ValueError, match="v_group_size must be one of"):
        mlxq.RotatingQuantizedKVCache(8, 0, 64, 8, v_group_size=48)
    cache = mlxq.QuantizedKVCache(64, 8, v_bits=4)
    cache.update_and_fetch(*kv(rng, 3))
    with pytest.raises(ValueError, match="extra entries"):
        mlxq.QuantizedKVCache.from_state(cache.state[:-1])
    with pytest.raises(ValueError, match=r"hadamard entry must be one of \(0, 1\)"):
        mlxq.QuantizedKVCache.from_state(cache.state[:-3] + (2, 64, 4))
    with pytest.raises(ValueError, match="values is not a triple of bits=8"):
        mlxq.QuantizedKVCache(64, 8).restore(*cache.state[:2], cache.offset)
    with pytest.raises(ValueError, match="v_bits must be one of"):
        mlxq_lm.enable(v_bits=9)


# ------------------------------------------------------------- mlx-lm
@pytest.mark.slow
@pytest.mark.parametrize("arch", STOCK_RUNS + STOCK_CRASHES)
def test_k8v4_generation_stays_close_to_unquantized(arch):
    # enable(v_bits=4) with kv_bits=8: every cache mlxq quantizes keeps 8-bit
    # keys and 4-bit values, through sliding windows, sinks and KV sharing.
    model, _ = random_model(arch, seed=1)
    prompt, cont = tokens(1, PROMPT_LEN), tokens(2, CONTINUATION)
    with mlxq_lm.enable(v_bits=4):
        mlxq_lm.reset_counters()
        ours, cache = teacher_forced(model, prompt, cont, 8)
        counts = mlxq_lm.counters()
    assert mlxq_lm.settings() == mlxq_lm.Settings()  # disable() resets it
    quantized = [c for c in cache if hasattr(c, "bits")]
    assert quantized and all(
        c.format.side(values=True) == (64, 4) and c.bits == 8 for c in quantized
    )
    assert counts["mlxq"] > 0 and counts.get("mlx_lm", 0) == runs(arch)["counts"].get("mlx_lm", 0)
    fp = runs(arch)["fp"]
    with mlxq_lm.enable(kv_recent=0):  # plain 4-bit (the recipe's window would be exact)
        kv4, _ = teacher_forced(model, prompt, cont, 4)
    assert np.isfinite(ours).all()
    # 8-bit keys keep at least kv4's agreement (random weights have no outlier
    # keys, so the 4-bit values dominate both; within noise of 64 steps).
    assert argmax_agreement(ours, fp) >= max(0.75, argmax_agreement(kv4, fp) - 0.05)


def test_values_of_their_own_width_never_fall_back_to_mlx_lm():
    q = mx.zeros((1, 2, 1, 64))
    k = tuple(mx.quantize(mx.ones((1, 2, 8, 64)), group_size=64, bits=8))
    v = FormattedTriple(
        mx.quantize(mx.ones((1, 2, 8, 64)), group_size=64, bits=4), KVFormat(64, 8, 64, 4), True
    )
    with mlxq_lm.enabled():
        with pytest.raises(ValueError, match="v_bits"):
            lm_base.scaled_dot_product_attention(q, k, v, None, scale=1.0, mask=object())
        cache = lm_cache.make_prompt_cache(random_model("llama")[0], kv_bits=8)
        assert all(c.format.side(values=True) == (64, 8) for c in cache)


def test_cli_separate_value_bits(capsys):
    from mlxq.generate import main

    args = ["--random-model", "llama", "--max-tokens", "4", "--prompt-tokens", "40"]
    main(args + ["--kv-bits", "8", "--v-bits", "4", "--v-group-size", "32"])
    out, err = capsys.readouterr()
    assert "Generation: 4 tokens" in out and mlxq_lm.settings() == mlxq_lm.Settings()
    assert "8-bit K (group 64), 4-bit V (group 32)" in err
    with pytest.raises(SystemExit):
        main(args + ["--v-bits", "4"])  # without --kv-bits
