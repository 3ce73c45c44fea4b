"""Compiled decode (mlxq.compiled): one ``mx.compile``d step per model.

First the building block: a compiled step over a cache's buffers with the
position passed as an array must trace once and replay for every token.
Then the whole path through mlx-lm's ``generate_step`` with
``enable(compiled_decode=True)``: greedy tokens and every step's
log-probabilities must be bit-identical to eager mlxq decode over 300+
tokens (cache growth, sliding-window rings wrapping, ``max_kv_size`` rings
with kept tokens, quantization starting mid-run, a trim), on random-weight
models of mlx-lm's llama, qwen3, gemma3 (sliding window), gpt-oss (sinks)
and gemma4 (KV sharing) classes, with and without ``kv_bits``; the trace
counter must equal the number of step signatures (one per 256 tokens of
growth, none once rings are full); turning the mode off must restore eager
decode; anything it cannot compile (unquantized caches, recent
windows, unknown model classes) must decode eagerly with a logged reason;
the cache protocol's misuse must raise ``ValueError``.

Bit-identity holds because a growing buffer is fetched whole with its
unwritten rows masked, at a capacity in the same 256-key class as the exact
fetch, and the kernels split keys by that class (csrc/row_tiling.h).
"""

import importlib
import logging

import mlx.core as mx
import numpy as np
import pytest
from support.caches import kv
from support.lm import run_continuous

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.cache.decode_step import key_class
from mlxq.compiled import CompiledDecode, decoder_for
from mlxq.random_models import random_model

SCALE = 128**-0.5


def compiled_step(quantized, traces):
    def step(kbuf, vbuf, k, v, q, pos):
        traces.append(1)  # runs only while tracing
        if quantized:
            kbuf = mlxq.quantized_ring_update(kbuf, k, pos, group_size=64, bits=8)
            vbuf = mlxq.quantized_ring_update(vbuf, v, pos, group_size=64, bits=8)
        else:
            kbuf, vbuf = mlxq.ring_update(kbuf, k, pos), mlxq.ring_update(vbuf, v, pos)
        length = (kbuf[0] if quantized else kbuf).shape[2]
        visible = mx.arange(length) <= pos  # slots written so far
        out = mlxq.sdpa(q, kbuf, vbuf, scale=SCALE, mask=visible)
        return kbuf, vbuf, out

    return mx.compile(step)


@pytest.mark.parametrize("quantized", [False, True])
def test_compiled_decode_step_does_not_retrace(rng, quantized):
    eager = mlxq.QuantizedKVCache(64, 8) if quantized else mlxq.KVCache()
    eager.update_and_fetch(*kv(rng, 5))
    # The compiled path works on copies of the eager cache's buffers.
    copy = (lambda t: tuple(map(mx.array, t))) if quantized else mx.array
    kbuf, vbuf = copy(eager.keys), copy(eager.values)
    traces = []
    step = compiled_step(quantized, traces)
    for _ in range(12):
        k, v = kv(rng, 1)
        q = mx.array(rng.standard_normal((1, 4, 1, 128), dtype=np.float32))
        pos = mx.array(eager.offset, dtype=mx.int32)
        kbuf, vbuf, out = step(kbuf, vbuf, k, v, q, pos)
        want = mlxq.sdpa(q, *eager.update_and_fetch(k, v), scale=SCALE)
        assert mx.allclose(out, want, rtol=1e-5, atol=1e-6).item()
    assert len(traces) == 1, f"traced {len(traces)} times for 12 tokens"
    # The compiled writes put the same bytes where the cache put them.
    for got, want in zip(kbuf if quantized else [kbuf], eager.keys if quantized else [eager.keys]):
        assert mx.array_equal(got[..., :17, :], want[..., :17, :]).item()


# ----------------------------------------------------------- through mlx-lm
generate_module = importlib.import_module("mlx_lm.generate")
PROMPT = 37


@pytest.fixture(autouse=True)
def _disabled():
    yield
    mlxq_lm.disable()


def _generate(model, prompt, n, compiled, kv_recent=0, **kw):
    # (kv_recent=0: the 4-bit recipe's window decodes eagerly, see below)
    mlxq_lm.enable(compiled_decode=compiled, kv_recent=kv_recent)
    kw.setdefault("quantized_kv_start", 0)
    steps = generate_module.generate_step(prompt, model, max_tokens=n, prefill_step_size=16, **kw)
    return [(t, lp) for t, lp in steps]


def _assert_identical(eager, compiled):
    assert [t for t, _ in compiled] == [t for t, _ in eager]
    for i, ((_, a), (_, b)) in enumerate(zip(eager, compiled)):
        assert mx.array_equal(a, b).item(), f"log-probabilities differ at step {i}"


def _signatures(positions, windows):
    """The step signatures a model's caches go through: growing caches'
    capacity class, each ring's (filling capacity or full)."""
    sigs = set()
    for p in positions:
        sig = [key_class(p + 1)]
        for w in windows:
            sig.append(("grow", min(key_class(p + 1), w)) if p < w else ("ring", w))
        sigs.add(tuple(sig))
    return len(sigs)


def _windows(cache):
    return sorted({c.max_size for c in cache if hasattr(c, "max_size")})


CASES = [
    ("llama", dict(kv_bits=4)),
    ("llama", dict()),
    ("llama", dict(kv_bits=8, max_kv_size=100)),  # a ring with 4 kept tokens, wrapping
    ("llama", dict(kv_bits=4, quantized_kv_start=120)),  # quantized mid-run
    ("qwen3", dict(kv_bits=4)),
    ("gemma3", dict(kv_bits=4)),
    ("gemma3", dict()),
    ("gpt_oss", dict(kv_bits=8)),
    ("gpt_oss", dict()),
    ("gemma4", dict(kv_bits=4)),
    ("gemma4", dict()),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,kw", CASES, ids=[f"{a}-" + "-".join(f"{k}{v}" for k, v in kw.items()) for a, kw in CASES]
)
def test_generate_step_is_bit_identical_to_eager(rng, arch, kw):
    model, _ = random_model(arch)
    prompt = mx.array(rng.integers(0, 256, (PROMPT,)))
    n = 310
    eager = _generate(model, prompt, n, False, **kw)
    dec = decoder_for(model)
    traces, steps = dec.traces, dec.steps
    compiled = _generate(model, prompt, n, True, **kw)
    _assert_identical(eager, compiled)
    # generate_step runs on mlx-lm's generation stream, made on the default
    # device at import: the GPU on a CUDA host, whatever this test's device.
    from mlx_lm.generate import generation_stream

    on_cuda = generation_stream.device == mx.gpu and mx.cuda.is_available()
    cuda_eager = on_cuda and arch == "gemma4"
    assert (dec.declined is not None) == cuda_eager, dec.declined
    # The one-token steps: the prompt's last token and n more (generate_step
    # computes one token ahead), at these write positions. Only steps over
    # quantized caches compile (see mlxq.compiled): the others, and gemma4's
    # on CUDA, run eagerly.
    start = kw.get("quantized_kv_start", 0) if kw.get("kv_bits") else PROMPT + n
    phases = [range(max(start, PROMPT - 1), PROMPT + n)]
    if cuda_eager:
        phases = []
    phases = [p for p in phases if len(p)]
    assert dec.steps - steps == sum(len(p) for p in phases)
    # One trace per step signature (quantizing mid-run gives the growing
    # signatures again, over new caches).
    cache = mlxq_lm.make_prompt_cache(model, max_kv_size=kw.get("max_kv_size"))
    if "max_kv_size" in kw:  # every layer a ring
        bound = sum(_ring_signatures(p, kw["max_kv_size"]) for p in phases)
    else:
        bound = sum(_signatures(p, _windows(cache)) for p in phases)
    assert dec.traces - traces == bound


def _ring_signatures(positions, w):
    return len({("grow", min(key_class(p + 1), w)) if p < w else ("ring", w) for p in positions})


def test_trim_then_decode_is_bit_identical(rng):
    """A trim (speculative decoding's rollback) and a continued compiled
    decode match eager decode over the same steps."""
    mlxq_lm.enable(kv_recent=0)
    model, _ = random_model("llama")
    prompt = mx.array(rng.integers(0, 256, (1, 300)))

    def run(compiled):
        cache = mlxq_lm.make_prompt_cache(model, kv_bits=4)
        dec = CompiledDecode(model) if compiled else None
        mx.eval(model(prompt, cache=cache))
        y, logits = mx.array([[7]]), []
        for i in range(60):
            if i == 30:
                for c in cache:
                    c.trim(9)
            out = dec(y, cache) if dec else model(y, cache=cache)
            assert out is not None
            logits.append(out)
            y = mx.argmax(out[:, -1], axis=-1)[:, None]
        return logits, dec

    eager, _ = run(False)
    compiled, dec = run(True)
    for a, b in zip(eager, compiled):
        assert mx.array_equal(a, b).item()
    assert dec.steps == 60 and dec.traces == 1  # 301-330, then 322-351: one class (512)


def test_handed_out_buffers_are_copied_not_overwritten(rng):
    """A cache whose state was handed out copies its buffers before the
    graph writes in place: the state a caller kept does not change."""
    mlxq_lm.enable(kv_recent=0)
    model, _ = random_model("llama")
    cache = mlxq_lm.make_prompt_cache(model, kv_bits=4)
    mx.eval(model(mx.array(rng.integers(0, 256, (1, 20))), cache=cache))
    views = [c.state[0] for c in cache]  # the buffers themselves, handed out
    host = lambda a: np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)  # noqa: E731
    snapshot = [tuple(host(a) for a in v) for v in views]
    dec = CompiledDecode(model)
    for _ in range(3):
        mx.eval(dec(mx.array([[3]]), cache))
    assert dec.steps == 3
    for v, snap in zip(views, snapshot):
        for a, b in zip(v, snap):
            assert np.array_equal(host(a), b)


def test_switching_the_mode_off_restores_eager_decode(rng):
    model, _ = random_model("llama")
    prompt = mx.array(rng.integers(0, 256, (PROMPT,)))
    _generate(model, prompt, 20, True, kv_bits=4)
    dec = decoder_for(model)
    steps = dec.steps
    assert steps >= 20
    _generate(model, prompt, 20, False, kv_bits=4)
    assert dec.steps == steps
    mlxq_lm.enable(compiled_decode=True)
    mlxq_lm.disable()
    assert not mlxq_lm.settings().compiled_decode
    mlxq_lm.enable()
    _generate(model, prompt, 20, False, kv_bits=4)
    assert dec.steps == steps


def test_what_it_cannot_compile_decodes_eagerly_with_a_reason(rng, caplog):
    """A recent cache and a model class it does not know fall back to
    eager decode, give the same tokens, and log why."""
    model, _ = random_model("llama")
    prompt = mx.array(rng.integers(0, 256, (PROMPT,)))
    eager = _generate(model, prompt, 30, False, kv_recent=8, kv_bits=4)
    with caplog.at_level(logging.DEBUG, logger="mlxq.compiled"):
        with pytest.warns(UserWarning, match="kv_recent=0"):
            compiled = _generate(model, prompt, 30, True, kv_recent=8, kv_bits=4)
    _assert_identical(eager, compiled)
    assert "recent" in caplog.text
    fresh, _ = random_model("llama")  # (each model's decoder warns once)
    with pytest.warns(UserWarning, match="kv_recent=0"):  # the recipe's window alike
        _generate(fresh, prompt, 3, True, kv_recent=None, kv_bits=4)
    mlxq_lm.disable()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="mlxq.compiled"):
        _assert_identical(_generate(model, prompt, 30, False), _generate(model, prompt, 30, True))
    assert "unquantized caches decode eagerly" in caplog.text

    class Unknown(type(model)):
        pass

    other = Unknown.__new__(Unknown)
    other.__dict__.update(model.__dict__)
    dict.update(other, model)
    caplog.clear()
    dec = CompiledDecode(other)
    cache = mlxq_lm.make_prompt_cache(other, kv_bits=4)
    mx.eval(other(prompt[None], cache=cache))
    with caplog.at_level(logging.DEBUG, logger="mlxq.compiled"):
        assert dec(mx.array([[1]]), cache) is None
    assert "not one compiled decode knows" in caplog.text and dec.declined


def test_cache_protocol_rejects_misuse(rng):
    cache = mlxq.QuantizedKVCache(64, 4)
    with pytest.raises(ValueError, match="empty"):
        cache.prepare_decode()
    cache.update_and_fetch(*kv(rng, 5))
    k, v = cache.keys, cache.values
    with pytest.raises(ValueError, match="plan"):
        cache.adopt_decode(None, k, v)
    plan = cache.prepare_decode()
    assert plan.kind == "grow" and plan.pos == 5 and plan.capacity == 256
    bad = tuple(a[..., :100, :] for a in cache.keys)
    with pytest.raises(ValueError, match="shapes"):
        cache.adopt_decode(plan, bad, cache.values)
    with pytest.raises(ValueError, match="triple"):
        cache.adopt_decode(plan, cache.keys[0], cache.values)
    cache.adopt_decode(plan, cache.keys, cache.values)
    assert cache.offset == 6
    with pytest.raises(ValueError, match="plan"):
        cache.adopt_decode(plan, cache.keys, cache.values)  # adopted already
    recent = mlxq.QuantizedKVCache(64, 4, recent=4)
    recent.update_and_fetch(*kv(rng, 5))
    with pytest.raises(ValueError, match="recent"):
        recent.prepare_decode()
    with pytest.raises(ValueError, match="compiled_decode must be a bool"):
        mlxq_lm.enable(compiled_decode="yes")


def test_ring_plans_follow_mlx_lms_ring(rng):
    """A ring's plans: filling, it grows by key classes; full, it writes at
    the ring index, wrapping to keep; after a multi-token step it is cut
    back to max_size first."""
    ring = mlxq.RotatingKVCache(300, keep=4)
    ring.update_and_fetch(*kv(rng, 10))
    plan = ring.prepare_decode()
    assert (plan.kind, plan.pos, plan.capacity) == ("grow", 10, 256)
    ring.adopt_decode(plan, ring.keys, ring.values)
    ring.update_and_fetch(*kv(rng, 400))  # a long step: 299 + 400 rows, temporal order
    plan = ring.prepare_decode()
    assert (plan.kind, plan.pos, plan.capacity) == ("ring", 4, 300)
    assert ring.keys.shape[2] == 300


def _continuous_batch(model, compiled, kv_bits=4):
    """A continuous batch (joins mid-generation, a removal, different
    lengths): each sequence's tokens and log-probabilities."""
    mlxq_lm.enable(compiled_decode=compiled, kv_recent=0)
    rng = np.random.default_rng(5)
    first = [[int(t) for t in rng.integers(1, 255, n)] for n in (9, 41, 3)]
    later = [[int(t) for t in rng.integers(1, 255, n)] for n in (26, 300)]
    lengths = [30, 280, 7, 15, 40]
    gen = generate_module.BatchGenerator(
        model, kv_bits=kv_bits, prefill_batch_size=2, completion_batch_size=8
    )
    uids, out = run_continuous(
        gen, first, later, lengths, join_at=4, remove=(6, 2), record=lambda r: (r.token, r.logprobs)
    )
    return [out[u] for u in uids]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_continuous_batch_is_bit_identical_to_eager(arch):
    """BatchGenerator's one-token steps over mlxq's quantized batch caches
    compile and give eager's tokens and log-probabilities, with sequences
    joining and leaving: llama's batches grow past 256 rows; gemma3's batch
    rings (window 32) fill, wrap and take joining sequences too."""
    model, _ = random_model(arch, seed=2)
    eager = _continuous_batch(model, False)
    dec = decoder_for(model)
    steps = dec.steps
    compiled = _continuous_batch(model, True)
    assert dec.steps - steps > 250 and dec.declined is None
    for a, b in zip(eager, compiled):
        _assert_identical(a, b)
