"""mlxq's caches under mlx-lm's own attention (mlxq not enabled): a fetch that
only mlxq reads correctly raises a clear error; a plain one reads as mlx-lm's.

Rotated rows, values quantized apart from the keys, and the exact recent
window would otherwise be read by mlx-lm's composition as plain rows: wrong
numbers, no error (see mlxq.guard)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from support.helpers import stock_or_skip

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.guard import parts
from mlxq.random_models import random_model

MLXQ_ONLY = {
    "hadamard": dict(bits=4, hadamard=True),
    "k8v4": dict(bits=8, v_bits=4),
    "recent": dict(bits=4, recent=32),
}


@pytest.fixture(autouse=True)
def stock_mlx_lm():
    mlxq_lm.disable()
    yield
    mlxq_lm.disable()


def prompt(n=40):
    return mx.array(np.random.default_rng(0).integers(0, 256, (1, n)))


@pytest.mark.parametrize("name", sorted(MLXQ_ONLY))
def test_mlx_lm_attention_refuses_fetches_only_mlxq_reads(name):
    model, _ = random_model("llama", seed=1)
    caches = [mlxq.QuantizedKVCache(group_size=64, **MLXQ_ONLY[name]) for _ in model.layers]
    with pytest.raises(ValueError, match=r"mlxq\.mlx_lm\.enable\(\)"):
        mx.eval(model(prompt(), cache=caches))


@pytest.mark.parametrize("name", sorted(MLXQ_ONLY))
def test_the_same_caches_attend_through_mlxq_once_enabled(name):
    model, _ = random_model("llama", seed=1)
    caches = [mlxq.QuantizedKVCache(group_size=64, **MLXQ_ONLY[name]) for _ in model.layers]
    with mlxq_lm.enabled():
        out = model(prompt(), cache=caches)
        mx.eval(out)
    assert np.isfinite(np.array(out.astype(mx.float32))).all()


def test_a_plain_fetch_reads_as_mlx_lm_reads_its_own():
    """Same-width unrotated rows stay a plain tuple: mlx-lm's own attention
    reads mlxq's cache exactly as it reads mlx-lm's QuantizedKVCache."""
    model, _ = random_model("llama", seed=1)
    one = mlxq.QuantizedKVCache(group_size=64, bits=4)
    keys, values = one.update_and_fetch(*[mx.zeros((1, 2, 1, 64), mx.bfloat16)] * 2)
    assert type(keys) is tuple and type(values) is tuple
    ours = [mlxq.QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    theirs = [lm_cache.QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    # mlx-lm's attention is its quantized_matmul composition, which MLX's CUDA
    # backend cannot run for these shapes: there the comparison skips.
    a = stock_or_skip(model, prompt(), cache=theirs)
    b = stock_or_skip(model, prompt(), cache=ours)
    assert mx.array_equal(a, b).item()


def test_parts_reads_any_fetch():
    cache = mlxq.QuantizedKVCache(group_size=64, bits=4, hadamard=True)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    with pytest.raises(ValueError, match="hadamard"):
        keys[0]
    packed, scales, biases = parts(keys)
    assert packed.shape == (1, 2, 3, 8) and scales.shape == biases.shape == (1, 2, 3, 1)
