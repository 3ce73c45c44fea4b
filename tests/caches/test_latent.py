"""MLA latent caches (``latent=True``) against mlx-lm's caches, and their attention.

An MLA model writes ``update_and_fetch(kv_latent, k_pe)``. The latent cache
must hand back the RoPE keys exactly as mlx-lm's ``KVCache`` does, the
latent of a one-row step exactly as ``mx.quantize`` quantizes it, and the
latent of a many-row step as that quantization dequantized.
Decode attention over the quantized latent (one KV head of 512 dims shared
by every query head, the RoPE scores as an additive mask) is checked against
the float64 reference.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm
from support.caches import assert_same, fresh, random_script
from support.helpers import assert_close
from support.reference64 import sdpa64

import mlxq
from mlxq.cache import BatchQuantizedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

LATENT, ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim


def latent_rows(rng, T, B=1, dtype=mx.float32):
    latent = mx.array(rng.standard_normal((B, 1, T, LATENT), dtype=np.float32)).astype(dtype)
    rope = mx.array(rng.standard_normal((B, 1, T, ROPE), dtype=np.float32)).astype(dtype)
    mx.eval(latent, rope)
    return latent, rope


@pytest.mark.parametrize("group_size,bits", [(64, 4), (64, 8), (32, 2), (128, 6)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_latent_cache_matches_mlx_lm(rng, group_size, bits, dtype):
    ours = QuantizedKVCache(group_size, bits, latent=True)
    plain = lm.KVCache()  # the latent as its keys, the RoPE keys as its values
    B = 2 if dtype == mx.bfloat16 else 1
    script = random_script(rng, 12, chunk_max=40, decode_max=6)
    for op, n in script:
        if op == "trim":
            assert ours.trim(n) == plain.trim(n)
            continue
        for T in [n] if op == "prefill" else [1] * n:
            latent, rope = latent_rows(rng, T, B, dtype)
            got_latent, got_rope = ours.update_and_fetch(latent, rope)
            all_latent, want_rope = plain.update_and_fetch(fresh(latent), fresh(rope))
            # Rows quantize on their own: mx.quantize of every latent so far
            # is what the cache must hold.
            want_latent = tuple(mx.quantize(all_latent, group_size=group_size, bits=bits))
            assert_same(got_rope, want_rope, "RoPE keys")
            if T == 1:  # decode: the quantized latent, for the fused kernel
                assert_same(got_latent, want_latent, "quantized latent")
            else:  # prefill: the latent dequantized, for the model's projections
                want = mx.dequantize(*want_latent, group_size=group_size, bits=bits)
                assert_same(got_latent, want, "dequantized latent")
            assert ours.offset == plain.offset


def test_latent_cache_holds_under_0_4x_bf16_bytes(rng):
    """4-bit: 256 B of codes + 32 B of scales and biases for the latent,
    128 B of exact RoPE keys per token, against 1152 B in bf16 (0.36x)."""
    T = 512  # two whole growth steps: no spare rows in either buffer
    latent, rope = latent_rows(rng, T, dtype=mx.bfloat16)
    ours, plain = QuantizedKVCache(64, 4, latent=True), lm.KVCache()
    ours.update_and_fetch(latent, rope)
    plain.update_and_fetch(latent, rope)
    assert ours.nbytes / T == 256 + 32 + 128
    assert plain.nbytes / T == (LATENT + ROPE) * 2
    assert ours.nbytes / plain.nbytes <= 0.40


@pytest.mark.parametrize("N", [1, 300, 2049])
def test_latent_decode_attention_matches_float64(rng, N):
    # DeepSeek-V3's decode: q_nope projected into the latent space, keys and
    # values both the quantized latent, the RoPE scores an additive mask.
    Hq = 16
    cache = QuantizedKVCache(64, 4, latent=True)
    cache.update_and_fetch(*latent_rows(rng, N, dtype=mx.bfloat16))
    latent, rope_keys = cache.update_and_fetch(*latent_rows(rng, 1, dtype=mx.bfloat16))
    q = mx.array(rng.standard_normal((1, Hq, 1, LATENT), dtype=np.float32)).astype(mx.bfloat16)
    q_pe = mx.array(rng.standard_normal((1, Hq, 1, ROPE), dtype=np.float32)).astype(mx.bfloat16)
    scale = (128 + ROPE) ** -0.5
    pe_scores = (q_pe * scale) @ rope_keys.swapaxes(-1, -2)
    out = mlxq.sdpa(q, latent, latent, scale=scale, mask=pe_scores)
    ref = sdpa64(q, latent, latent, scale=scale, mask=pe_scores, group_size=64, bits=4)
    assert out.shape == (1, Hq, 1, LATENT)
    assert_close(out, ref, mx.bfloat16)


def test_latent_state_round_trips_through_prompt_cache_files(rng, tmp_path):
    cache = QuantizedKVCache(64, 4, latent=True)
    cache.update_and_fetch(*latent_rows(rng, 37))
    file = str(tmp_path / "mla.safetensors")
    mlxq.save_prompt_cache(file, [cache])
    (loaded,) = mlxq.load_prompt_cache(file)
    assert loaded.format == cache.format and loaded.offset == 37
    step = latent_rows(rng, 1)
    assert_same(loaded.update_and_fetch(*step), cache.update_and_fetch(*step), "next fetch")
    # mlx-lm has no latent cache: its loader must refuse the file, not
    # misread exact RoPE keys as quantized values.
    with pytest.raises(ValueError, match="too many values"):
        lm.load_prompt_cache(file)


def test_latent_batch_matches_single_caches(rng):
    singles = [QuantizedKVCache(64, 4, latent=True) for _ in range(3)]
    for c, n in zip(singles, (5, 17, 9)):
        c.update_and_fetch(*latent_rows(rng, n))
    batch = BatchQuantizedKVCache.merge(singles)
    assert batch.format.latent
    latent, rope = latent_rows(rng, 1, B=3)
    got_latent, got_rope = batch.update_and_fetch(latent, rope)
    for b, c in enumerate(singles):
        want_latent, want_rope = c.update_and_fetch(latent[b : b + 1], rope[b : b + 1])
        n = c.offset
        assert_same(got_rope[b : b + 1, :, -n:], want_rope, f"sequence {b} RoPE keys")
        assert_same(
            tuple(a[b : b + 1, :, -n:] for a in got_latent), want_latent, f"sequence {b} latent"
        )
    extracted = batch.extract(1)
    assert extracted.format.latent and extracted.offset == singles[1].offset
    step = latent_rows(rng, 1)
    assert_same(extracted.update_and_fetch(*step), singles[1].update_and_fetch(*step), "extracted")
    batch.filter([0, 2])
    assert batch.offset.tolist() == [singles[0].offset, singles[2].offset]


def test_plain_cache_quantizes_into_a_latent_cache(rng):
    plain = KVCache()
    latent, rope = latent_rows(rng, 20)
    plain.update_and_fetch(latent, rope)
    cache = plain.to_quantized(64, 8, latent=True)
    assert cache.format.latent and cache.offset == 20
    step = latent_rows(rng, 3)
    got_latent, got_rope = cache.update_and_fetch(*step)
    assert_same(got_rope, mx.concatenate([rope, step[1]], axis=2), "RoPE keys")
    want = mx.quantize(mx.concatenate([latent, step[0]], axis=2), group_size=64, bits=8)
    assert_same(got_latent, mx.dequantize(*want, group_size=64, bits=8), "latent")


def test_latent_refusals(rng):
    with pytest.raises(ValueError, match="takes no hadamard"):
        QuantizedKVCache(64, 4, hadamard=True, latent=True)
    with pytest.raises(ValueError, match="takes no hadamard"):
        QuantizedKVCache(64, 8, v_bits=4, latent=True)
    with pytest.raises(ValueError, match="no recent window"):
        QuantizedKVCache(64, 4, recent=16, latent=True)
    with pytest.raises(ValueError, match="without max_kv_size"):
        RotatingKVCache(64).to_quantized(64, 4, latent=True)
    cache = QuantizedKVCache(64, 4, latent=True)
    cache.update_and_fetch(*latent_rows(rng, 4))
    with pytest.raises(ValueError, match="decodes eagerly"):
        cache.prepare_decode()
    with pytest.raises(ValueError, match="head dim 100 is not a multiple"):
        QuantizedKVCache(64, 4, latent=True).update_and_fetch(
            mx.zeros((1, 1, 2, 100)), mx.zeros((1, 1, 2, ROPE))
        )
