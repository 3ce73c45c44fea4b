"""Teacher-forced runs of tiny random-weight mlx-lm models, shared by the
mlx-lm tests: each model's fp / stock / mlxq / composition logits are
computed once per device and reused."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.random_models import random_model

from .helpers import stock_or_skip

lm_generate = importlib.import_module("mlx_lm.generate")

PROMPT_LEN, CONTINUATION, PREFILL_STEP, BITS, GROUP = 100, 64, 48, 8, 64
STOCK_RUNS = ("llama", "qwen3")
STOCK_CRASHES = ("gemma3", "gpt_oss", "gemma4")


def tokens(seed: int, n: int, vocab: int = 256):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def teacher_forced(
    model, prompt, continuation, kv_bits=None, cache=None, step=PREFILL_STEP, logprobs=False
):
    """Per-step logits [steps, vocab] (float64), as generate_step would feed it
    (``logprobs``: generate_step's log-probabilities, in the model's dtype)."""
    if cache is None:
        cache = lm_cache.make_prompt_cache(model)

    def quantize():  # the module's function at call time: mlxq's when enabled
        lm_generate.maybe_quantize_kv_cache(cache, 0, GROUP, kv_bits)

    rest = prompt[:-1]
    while rest:
        model(mx.array([rest[:step]]), cache=cache)
        quantize()
        mx.eval([c.state for c in cache])
        rest = rest[step:]
    out = []
    for t in [prompt[-1]] + continuation[:-1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        quantize()
        if logprobs:
            logits = logits - mx.logsumexp(logits, keepdims=True)
        out.append(np.array(logits.astype(mx.float32), dtype=np.float64))
    return np.stack(out), cache


def run_error(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def step_errors(a, b) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


def argmax_agreement(a, b) -> float:
    return float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))


def composition(q, k, v, *, scale, mask=None, sinks=None, group_size=None, bits=None):
    """mlx-lm's composition, with bits/group size inferred as the kernel does."""
    Dk = q.shape[-1]
    group_size = group_size or Dk // k[1].shape[-1]
    bits = bits or k[0].shape[-1] * 32 // Dk
    return mlxq.reference.quantized_sdpa(
        q, k, v, scale=scale, mask=mask, sinks=sinks, group_size=group_size, bits=bits
    )


def deferred_baseline(fn, *args):
    """``stock_or_skip(fn, *args)``, or the skip it raised, kept for the test that
    needs the baseline (``baseline``), so one shared run still gives the other
    tests the mlxq and fp logits."""
    try:
        return stock_or_skip(fn, *args)
    except pytest.skip.Exception as e:
        return e


def baseline(r, name):
    """``r[name]`` (a stock baseline's logits), or skip where it could not run here."""
    value = r[name]
    if isinstance(value, pytest.skip.Exception):
        pytest.skip(value.msg)
    return value


_RUNS = {}


def runs(arch):
    """fp / stock / mlxq / comp teacher-forced logits of one model (computed once)."""
    key = (arch, str(mx.default_device()))
    if key in _RUNS:
        return _RUNS[key]
    model, _ = random_model(arch, seed=1)
    prompt, cont = tokens(1, PROMPT_LEN), tokens(2, CONTINUATION)
    res = {"fp": teacher_forced(model, prompt, cont)[0]}
    if arch in STOCK_RUNS:
        res["stock"] = deferred_baseline(lambda: teacher_forced(model, prompt, cont, BITS)[0])
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        res["mlxq"] = teacher_forced(model, prompt, cont, BITS)[0]
        res["counts"] = mlxq_lm.counters()
        kernel, mlxq_lm.attention.kernel = mlxq_lm.attention.kernel, composition
        try:
            res["comp"] = deferred_baseline(lambda: teacher_forced(model, prompt, cont, BITS)[0])
        finally:
            mlxq_lm.attention.kernel = kernel
    _RUNS[key] = res
    return res


def run_continuous(
    gen, first, later, lengths, *, join_at, remove=None, each_step=None, record=None
):
    """Drive ``gen``: insert ``first`` (their lengths first in ``lengths``),
    insert ``later`` after ``join_at`` steps, remove the ``remove[1]``-th
    sequence after ``remove[0]`` steps, call ``each_step()`` after every
    step, until done. Returns (uids, what ``record(response)`` gives per
    step for each uid: its token by default)."""
    uids = gen.insert(first, lengths[: len(first)])
    out = {u: [] for u in uids}
    steps = 0
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        steps += 1
        for r in responses:
            out[r.uid].append(r.token if record is None else record(r))
        if steps == join_at:
            more = gen.insert(later, lengths[len(first) :])
            out.update({u: [] for u in more})
            uids += more
        if remove is not None and steps == remove[0]:
            gen.remove([uids[remove[1]]])
        if each_step is not None:
            each_step()
    gen.close()
    return uids, out
