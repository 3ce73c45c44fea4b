"""Batch generation with quantized KV through mlx-lm (``mlxq.mlx_lm.enable``).

Greedy tokens of a batch (``batch_generate`` and a continuous
``BatchGenerator`` with sequences joining and leaving) must equal those of
the same prompts generated one at a time by ``generate_step`` with the same
``kv_bits``, on random-weight models of mlx-lm's llama, qwen3 and gemma3
classes (gemma3's sliding-window layers wrap: window 32, prompts up to 60
tokens). The models run in float32: in bf16, a batched matmul rounds some
rows differently from a one-row one, and random weights have near-ties
that such a rounding flips (a batch-vs-single difference mlx-lm has
without mlxq too).
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from support.helpers import on_cuda_gpu
from support.lm import run_continuous

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.random_models import random_model

lm_generate = importlib.import_module("mlx_lm.generate")
ARCHS = ["llama", "qwen3", "gemma3"]
MAX_TOKENS = 20


@pytest.fixture
def enabled():
    mlxq_lm.enable()
    mlxq_lm.reset_counters()
    yield
    mlxq_lm.disable()


def prompts(seed, lengths=(5, 33, 17, 60)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 255, n)] for n in lengths]


def one_by_one(model, prompt, kv_bits, max_tokens=MAX_TOKENS, group_size=64):
    steps = lm_generate.generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        kv_bits=kv_bits,
        kv_group_size=group_size,
        quantized_kv_start=0,
    )
    return [int(t) for t, _ in steps]


def one_by_one_with_logprobs(model, prompt, kv_bits, max_tokens=MAX_TOKENS):
    steps = lm_generate.generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, kv_bits=kv_bits, quantized_kv_start=0
    )
    return [(int(t), np.array(lp.astype(mx.float32))) for t, lp in steps]


def assert_same_tokens(model, prompts_, got, kv_bits, near_tie=0.05, max_tokens=MAX_TOKENS):
    """Each sequence's batch tokens equal its one-at-a-time tokens. On CUDA,
    where MLX's f32 matmuls round like TF32 and differently for a batch of
    rows than for one, a sequence may part ways at a near-tie only: at the
    first differing step, the token the batch chose must be within
    ``near_tie`` (log-probability) of the one-at-a-time choice there."""
    for p, ids in zip(prompts_, got):
        alone = one_by_one_with_logprobs(model, p, kv_bits, max_tokens)
        want = [t for t, _ in alone]
        if ids == want or not on_cuda_gpu():
            assert ids == want
            continue
        i = next(i for i, (a, b) in enumerate(zip(ids, want)) if a != b)
        lp = alone[i][1]
        assert lp[want[i]] - lp[ids[i]] <= near_tie, (i, lp[want[i]], lp[ids[i]])


def quantized_layers(cache):
    return [c for c in cache if hasattr(c, "bits")]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_generate_equals_one_by_one(enabled, arch):
    model, tok = random_model(arch, seed=1, dtype=mx.float32)
    ps = prompts(0)
    got = lm_generate.batch_generate(
        model,
        tok,
        ps,
        max_tokens=MAX_TOKENS,
        kv_bits=4,
        return_token_ids=True,
        return_prompt_caches=True,
    )
    assert mlxq_lm.counters().get("mlxq", 0) > 0
    assert mlxq_lm.counters().get("mlx_lm", 0) == 0  # every attention call was mlxq's
    assert_same_tokens(model, ps, got.token_ids, 4)
    for p, ids, cache in zip(ps, got.token_ids, got.caches):
        layers = quantized_layers(cache)
        assert len(layers) == len(cache)  # every layer's cache came back quantized
        assert all((c.bits, c.v_bits) == (8, 4) for c in layers)  # the recipe
        # the prompt and every generated token (the last one too: mlx-lm
        # has fed it to the model for the next step before it stops)
        assert max(c.offset for c in cache) == len(p) + len(ids)
    if arch == "gemma3":
        assert any(isinstance(c, mlxq.RotatingQuantizedKVCache) for c in got.caches[0])


def test_rotated_and_pair_quantization_batch_too():
    """enable(kv_hadamard=True, v_bits=...) reaches the batch caches: the batch
    equals one-by-one generation with the same settings."""
    model, tok = random_model("llama", seed=6, dtype=mx.float32)
    ps = prompts(6, (7, 30, 19))
    with mlxq_lm.enable(kv_hadamard=True, v_bits=4):
        got = lm_generate.batch_generate(
            model,
            tok,
            ps,
            max_tokens=12,
            kv_bits=8,
            return_token_ids=True,
            return_prompt_caches=True,
        )
        cache = got.caches[0][0]
        assert cache.hadamard and (cache.bits, cache.v_bits) == (8, 4)
        assert_same_tokens(model, ps, got.token_ids, 8, max_tokens=12)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_continuous_batching_with_joins_and_leaves(enabled, arch):
    """Sequences join a running batch (extend), one is removed mid-way
    (filter), others finish at different lengths: each sequence's tokens
    are still those of generating it alone."""
    model, tok = random_model(arch, seed=2, dtype=mx.float32)
    first, later = prompts(1, (9, 41, 3)), prompts(2, (26, 50))
    lengths = [12, 20, 7, 15, 18]
    gen = lm_generate.BatchGenerator(
        model, kv_bits=8, kv_group_size=32, prefill_batch_size=2, completion_batch_size=8
    )
    uids, out = run_continuous(gen, first, later, lengths, join_at=4, remove=(6, 2))
    removed = uids[2]
    kinds = {type(c).__name__ for c in gen._generation_batch.prompt_cache}
    assert not kinds - {"BatchQuantizedKVCache", "BatchRotatingQuantizedKVCache"}
    for uid, p, n in zip(uids, first + later, lengths):
        want = one_by_one(model, p, 8, max_tokens=n, group_size=32)
        if uid == removed:
            assert out[uid] == want[: len(out[uid])] and len(out[uid]) < n
        else:
            assert out[uid] == want


def test_quantized_kv_start_quantizes_the_batch_once_it_is_long_enough(enabled):
    model, tok = random_model("llama", seed=3, dtype=mx.float32)
    gen = lm_generate.BatchGenerator(model, kv_bits=4, quantized_kv_start=40)
    gen.insert(prompts(3, (10, 20)), [40, 40])
    seen = []
    while gen.next_generated():
        cache = gen._generation_batch.prompt_cache
        if cache:
            seen.append((cache[0].size(), hasattr(cache[0], "bits")))
    gen.close()
    assert any(not q for _, q in seen) and any(q for _, q in seen)
    # unquantized exactly until the batch held quantized_kv_start tokens
    assert all(q == (size >= 40) for size, q in seen[:-1])


def test_prompt_caches_come_back_quantized_and_continue(enabled):
    """A finished sequence's cache (mlxq's, quantized) continues in a new
    batch as if generation had gone on."""
    model, tok = random_model("qwen3", seed=4, dtype=mx.float32)
    ps = prompts(4, (12, 30))
    first = lm_generate.batch_generate(
        model, tok, ps, max_tokens=6, kv_bits=4, return_token_ids=True, return_prompt_caches=True
    )
    follow = [[7, 8, 9], [10]]
    second = lm_generate.batch_generate(
        model,
        tok,
        follow,
        prompt_caches=first.caches,
        max_tokens=6,
        kv_bits=4,
        return_token_ids=True,
    )
    for p, ids, f, ids2 in zip(ps, first.token_ids, follow, second.token_ids):
        assert ids2 == one_by_one(model, p + ids + f, 4, max_tokens=6)[:6]


# mlx-lm's BatchGenerator.__del__ reads an attribute that a failed __init__ never set
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_disable_restores_mlx_lm():
    original = lm_generate.BatchGenerator
    merge, extend = lm_generate._merge_caches, lm_generate._extend_cache
    with mlxq_lm.enabled():
        assert lm_generate.BatchGenerator is not original
        assert hasattr(lm_cache.BatchKVCache, "to_quantized")
    assert lm_generate.BatchGenerator is original
    assert (lm_generate._merge_caches, lm_generate._extend_cache) == (merge, extend)
    assert not hasattr(lm_cache.BatchKVCache, "to_quantized")
    with pytest.raises(NotImplementedError):
        lm_cache.BatchRotatingKVCache(8, [0]).to_quantized()
    model, tok = random_model("llama", seed=0)
    with pytest.raises(TypeError):
        lm_generate.BatchGenerator(model, kv_bits=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_bits=7), "kv_bits must be one of"),
        (dict(kv_bits=4, kv_group_size=48), "kv_group_size must be one of"),
        (dict(kv_bits=4, quantized_kv_start="0"), "quantized_kv_start must be an int"),
    ],
)
def test_bad_generator_options(enabled, kwargs, match):
    model, _ = random_model("llama", seed=0)
    with pytest.raises(ValueError, match=match):
        lm_generate.BatchGenerator(model, **kwargs)


def test_to_quantized_on_mlx_lm_batch_caches(enabled):
    rng = np.random.default_rng(5)
    k = mx.array(rng.standard_normal((2, 2, 7, 64)).astype(np.float32))
    for batch in (lm_cache.BatchKVCache([2, 0]), lm_cache.BatchRotatingKVCache(5, [2, 0])):
        batch.update_and_fetch(k, k)
        q = batch.to_quantized(group_size=32, bits=8)
        assert isinstance(q, (mlxq.BatchQuantizedKVCache, mlxq.BatchRotatingQuantizedKVCache))
        assert np.array_equal(np.array(q.offset), np.array(batch.offset))
        want = mx.quantize(batch.keys, group_size=32, bits=8)
        assert all(mx.array_equal(a, b).item() for a, b in zip(q.keys, want))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_request_joining_mid_prefill_with_rotated_rows(arch):
    """A prompt joins while another is still being prefilled in chunks
    (an empty batch cache extends a filled one, rows rotated)."""
    model, tok = random_model(arch, seed=7, dtype=mx.float32)
    first, later = prompts(7, (60,)), prompts(8, (9,))
    with mlxq_lm.enable(kv_hadamard=True):
        gen = lm_generate.BatchGenerator(model, kv_bits=4, prefill_step_size=16)
        out = {u: [] for u in gen.insert(first, [10])}
        gen.next()  # the first 16-token chunk of the 60-token prompt
        out.update({u: [] for u in gen.insert(later, [10])})
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
        gen.close()
        assert_same_tokens(model, first + later, list(out.values()), 4, max_tokens=10)


def test_an_unquantized_batch_joined_by_a_quantized_one_takes_its_format():
    # mlx-lm's _extend_cache, replaced: where only the joining batch is
    # quantized, the running one is quantized in its format (Hadamard basis
    # and separate values included), and the whole batch attends as one.
    from mlxq.mlx_lm.batching import extend_cache

    rng = np.random.default_rng(5)
    rows = lambda B, T: [  # noqa: E731
        mx.array(rng.standard_normal((B, 2, T, 64)).astype(np.float32)) for _ in range(2)
    ]
    running = lm_cache.BatchKVCache([0, 2])
    running.update_and_fetch(*rows(2, 6))
    joining = mlxq.BatchQuantizedKVCache([1], 64, 8, hadamard=True, v_bits=4)
    joining.update_and_fetch(*rows(1, 4))
    (merged,) = extend_cache([running], [joining])
    assert isinstance(merged, mlxq.BatchQuantizedKVCache)
    assert merged.format == joining.format and merged.batch_size == 3
    k, v = merged.update_and_fetch(*rows(3, 1))
    assert k.format.hadamard and (v.group_size, v.bits) == (64, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_recent_window_batches_too(arch):
    """enable(kv_recent=R) reaches the batch caches, growing ones and
    sliding-window rings (gemma3): every sequence keeps its last R tokens
    exact through prefill, joins and leaves, and its tokens equal generating
    it alone with the same window. A window that the batch dropped would
    read those tokens 4-bit (the one-by-one tokens part from the batch's
    within a few steps on these models)."""
    model, tok = random_model(arch, seed=5, dtype=mx.float32)
    first, later = prompts(3, (9, 41, 23)), prompts(4, (30, 47))
    lengths = [14, 20, 9, 16, 18]
    kinds = (mlxq.BatchQuantizedKVCache, mlxq.BatchRotatingQuantizedKVCache)
    with mlxq_lm.enable(kv_recent=8):
        gen = lm_generate.BatchGenerator(
            model, kv_bits=4, prefill_batch_size=2, completion_batch_size=8
        )
        windows = []

        def each_step():
            batch = gen._generation_batch.prompt_cache
            windows.extend(c._recent for c in batch if isinstance(c, kinds))

        uids, out = run_continuous(gen, first, later, lengths, join_at=3, each_step=each_step)
        assert windows and all(w is not None and w.size == 8 for w in windows)
        for uid, p, n in zip(uids, first + later, lengths):
            assert out[uid] == one_by_one(model, p, 4, max_tokens=n), uid


@pytest.mark.parametrize(
    "bits, recent, want", [(4, None, 128), (3, None, 128), (8, None, 0), (4, 0, 0), (4, 16, 16)]
)
def test_the_recipe_reaches_batches(bits, recent, want):
    """``kv_bits`` of 4 or fewer keeps the recipe's window in batch caches,
    rings included (at most their max_size - 1), unless kv_recent says
    otherwise; 8 bits keep none."""
    model, tok = random_model("gemma3", seed=5, dtype=mx.float32)
    with mlxq_lm.enable(kv_recent=recent):
        gen = lm_generate.BatchGenerator(model, kv_bits=bits, completion_batch_size=4)
        gen.insert(prompts(3, (9, 41)), [2, 2])
        gen.next_generated()
        caches = gen._generation_batch.prompt_cache
        gen.close()
    sizes = {type(c).__name__: getattr(c, "recent", None) for c in caches}
    rings = [c for c in caches if isinstance(c, mlxq.BatchRotatingQuantizedKVCache)]
    assert rings and sizes["BatchQuantizedKVCache"] == want
    assert all(c.recent == min(want, c.max_size - 1) for c in rings)
