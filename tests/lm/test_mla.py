"""MLA models (DeepSeek-V3's attention) with a quantized latent cache, end to end.

A random-weight model of mlx-lm's deepseek_v3 class at DeepSeek-V3's
attention dims (kv_lora_rank 512, RoPE 64, nope 128, v 128), in float32,
generates greedily through mlx-lm's ``generate_step`` and ``batch_generate``
with mlxq enabled. With 8-bit latents the tokens must equal the unquantized
run's; every decode step's attention must go to mlxq's fused kernel over
the quantized latent; prefill runs mlx-lm's attention over the latent
dequantized; the caches must come back as latent caches.
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.random_models import random_model

lm_generate = importlib.import_module("mlx_lm.generate")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return random_model("deepseek_v3", seed=3, dtype=mx.float32)[0]


@pytest.fixture
def enabled():
    mlxq_lm.enable()
    mlxq_lm.reset_counters()
    yield
    mlxq_lm.disable()


def prompt(n=45, seed=0):
    return mx.array(np.random.default_rng(seed).integers(1, 255, n).astype(np.int32))


def greedy(model, p, **kw):
    return [int(t) for t, _ in lm_generate.generate_step(p, model, max_tokens=MAX_TOKENS, **kw)]


def latent_caches(model, bits):
    return [mlxq.QuantizedKVCache(64, bits, latent=True) for _ in model.layers]


def test_kv8_latent_tokens_equal_unquantized(enabled, model):
    p = prompt()
    want = greedy(model, p)
    cache = latent_caches(model, 8)
    mlxq_lm.reset_counters()
    got = greedy(model, p, prompt_cache=cache)
    assert got == want
    # generate_step prefills the prompt but its last token in one chunk
    # (mlx-lm's attention over the dequantized latent), then makes
    # MAX_TOKENS + 1 one-token calls (the last one ahead of need), each
    # layer's on mlxq's fused kernel over the quantized latent.
    layers = len(model.layers)
    assert mlxq_lm.counters() == {"mlx_lm": layers, "mlxq": layers * (MAX_TOKENS + 1)}
    assert all(c.format.latent and c.offset == len(p) + MAX_TOKENS for c in cache)


def test_kv4_latent_stays_close(enabled, model):
    p = prompt(seed=1)
    want = greedy(model, p)
    got = greedy(model, p, prompt_cache=latent_caches(model, 4))
    assert len(got) == MAX_TOKENS
    assert sum(a == b for a, b in zip(got, want)) >= MAX_TOKENS // 2


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bits_gives_latent_caches(enabled, model, bits):
    """``kv_bits`` alone: mlxq gives the model latent caches from the first
    token (stock mlx-lm quantizes the RoPE keys and then fails inside the
    model)."""
    p = prompt(seed=2)
    cache = mlxq_lm.make_prompt_cache(model)
    got = greedy(model, p, prompt_cache=cache, kv_bits=bits, quantized_kv_start=0)
    assert all(getattr(c, "format", None) is not None and c.format.latent for c in cache)
    assert all(c.bits == bits for c in cache)
    assert all(c.recent == 0 for c in cache)  # the 4-bit recipe's window passes latents by
    if bits == 8:
        assert got == greedy(model, p)


def test_batch_generation_with_latent_caches(enabled, model):
    ps = [[int(t) for t in prompt(n, seed=n)] for n in (7, 30, 18)]
    got = lm_generate.batch_generate(
        model,
        mlxq.random_models.random_model("deepseek_v3")[1],
        ps,
        max_tokens=12,
        kv_bits=8,
        return_token_ids=True,
        return_prompt_caches=True,
    )
    for p, ids, cache in zip(ps, got.token_ids, got.caches):
        alone = lm_generate.generate_step(
            mx.array(p), model, max_tokens=12, kv_bits=8, quantized_kv_start=0
        )
        assert ids == [int(t) for t, _ in alone]
        assert all(c.format.latent for c in cache)


def test_batch_quantizes_latent_caches_once_long_enough(enabled, model):
    ps = [[int(t) for t in prompt(n, seed=n)] for n in (7, 30)]
    got = lm_generate.batch_generate(
        model,
        mlxq.random_models.random_model("deepseek_v3")[1],
        ps,
        max_tokens=12,
        kv_bits=8,
        quantized_kv_start=20,
        return_token_ids=True,
        return_prompt_caches=True,
    )
    for cache in got.caches:
        assert all(c.format.latent and c.bits == 8 for c in cache)
