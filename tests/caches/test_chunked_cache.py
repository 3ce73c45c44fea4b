"""``ChunkedQuantizedKVCache`` against mlx-lm's ``ChunkedKVCache``, step by step.

Random scripts of prefill chunks, one-token decode steps, front trims
(``maybe_trim_front``, which Llama 4 calls before every model call) and
trims run on mlx-lm's ``ChunkedKVCache`` and on mlxq's quantized chunked
cache side by side. After every step the quantized fetch must be exactly
``mx.quantize`` of mlx-lm's fetch (as mlx-lm's ``QuantizedKVCache`` stores
rows), and ``offset`` / ``start_position`` must agree; the mask must be the
one Llama 4 builds; the state must round-trip through ``from_state`` and a
prompt-cache file.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm
from support.caches import assert_same, fresh, kv
from support.helpers import quantize

import mlxq
from mlxq.cache import ChunkedQuantizedKVCache

QUANT = [(32, 4), (64, 8), (128, 3)]  # (group_size, bits)


def llama4_mask(start, offset, N, chunk):
    """mlx-lm's llama4 chunk mask (LlamaModel.__call__)."""
    end = offset + N
    linds = mx.arange(start, end)
    rinds = mx.arange(offset, end)[:, None]
    block_pos = mx.abs((linds // chunk) - (rinds // chunk))
    return (block_pos == 0) & (linds <= rinds)


def check(ours, ref, group_size, bits, what):
    assert (ours.offset, ours.start_position) == (ref.offset, ref.start_position), what
    if ref.keys is None:
        assert ours.keys is None
        return
    k, v = ref.keys_and_values()
    qk, qv = ours.keys_and_values()
    assert_same(qk, quantize(k, group_size, bits), f"{what}: keys")
    assert_same(qv, quantize(v, group_size, bits), f"{what}: values")


@pytest.mark.parametrize("group_size,bits", QUANT)
@pytest.mark.parametrize("chunk", [5, 16, 300])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_lockstep_with_mlx_lm(group_size, bits, chunk, dtype):
    rng = np.random.default_rng(chunk * 1000 + bits)
    ref = lm.ChunkedKVCache(chunk)
    ours = ChunkedQuantizedKVCache(chunk, group_size=group_size, bits=bits)
    seen = set()
    for step in range(60):
        ref.maybe_trim_front()
        ours.maybe_trim_front()
        check(ours, ref, group_size, bits, f"step {step}: after maybe_trim_front")
        r = rng.random()
        if r < 0.15 and ref.keys is not None:
            n = int(rng.integers(0, 5))
            assert ours.trim(n) == ref.trim(n)
            seen.add("trim")
        else:
            T = int(rng.integers(2, 40)) if r < 0.35 else 1
            k, v = kv(rng, T, dtype=dtype)
            mask = ours.make_mask(T)
            assert_same(mask, llama4_mask(ref.start_position, ref.offset, T, chunk), "mask")
            got = ours.update_and_fetch(k, v)
            want = ref.update_and_fetch(fresh(k), fresh(v))
            assert_same(got[0], quantize(want[0], group_size, bits), f"step {step}: fetch")
            assert_same(got[1], quantize(want[1], group_size, bits), f"step {step}: fetch")
            if ref.start_position:
                seen.add("front")
        check(ours, ref, group_size, bits, f"step {step}")
    assert "trim" in seen and (chunk > 200 or "front" in seen)


def test_from_cache_state_and_file(tmp_path):
    rng = np.random.default_rng(0)
    ref = lm.ChunkedKVCache(8)
    for T in (20, 1, 1, 3):
        ref.maybe_trim_front()
        ref.update_and_fetch(*kv(rng, T))
    ref.maybe_trim_front()
    ours = ChunkedQuantizedKVCache.from_cache(ref, group_size=64, bits=4)
    check(ours, ref, 64, 4, "from_cache")
    twin = ChunkedQuantizedKVCache.from_state(ours.state)
    assert twin.meta_state == ours.meta_state
    assert (twin.chunk_size, twin.start_position, twin.bits) == (8, ref.start_position, 4)
    check(twin, ref, 64, 4, "from_state")
    # Both continue alike.
    k, v = kv(rng, 1)
    want = ref.update_and_fetch(fresh(k), fresh(v))
    assert_same(twin.update_and_fetch(k, v)[0], quantize(want[0], 64, 4), "continued")
    # Prompt-cache files: mlxq's loader knows the class; mlx-lm's finds it
    # where its cache module has it registered (enable() does).
    path = str(tmp_path / "c.safetensors")
    mlxq.save_prompt_cache(path, [ours])
    (back,) = mlxq.load_prompt_cache(path)
    assert type(back) is ChunkedQuantizedKVCache
    assert_same(back.keys_and_values(), ours.keys_and_values(), "loaded")


def test_bad_state_and_batching():
    cache = ChunkedQuantizedKVCache(4, group_size=64, bits=4)
    cache.update_and_fetch(*kv(np.random.default_rng(1), 6))
    state = list(cache.state)
    state[4] = 0  # start_position 0 with 6 tokens in a 256-row buffer: fine
    ChunkedQuantizedKVCache.from_state(state)
    state[2] = 500  # offset beyond the buffer
    with pytest.raises(ValueError, match="do not fit"):
        ChunkedQuantizedKVCache.from_state(state)
    with pytest.raises(ValueError, match="batched"):
        ChunkedQuantizedKVCache.merge([cache, cache])
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedQuantizedKVCache(0)
