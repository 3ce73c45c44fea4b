"""End to end through mlx-lm: tiny random-weight models of mlx-lm's own classes.

Every model runs the same 100-token prompt (prefilled in chunks of 48, as
``generate_step`` prefills) and is then teacher-forced over the same 64-token
continuation, one token per step, collecting each step's logits, with:

* ``fp``    — mlx-lm, unquantized (bf16) KV cache;
* ``stock`` — mlx-lm's own ``kv_bits=8`` path (``quantized_kv_start=0``), where it runs
  (not on MLX's CUDA backend, whose ``quantized_matmul`` has no kernel for these
  shapes: the comparisons with it, and with ``comp``, skip there; mlxq's own checks
  run first and still count);
* ``mlxq``  — the same ``kv_bits=8`` with ``mlxq.mlx_lm`` enabled;
* ``comp``  — mlxq's caches with mlx-lm's quantized attention composition
  (``mlxq.reference.quantized_sdpa``: mlx-lm's two ``quantized_matmul`` plus
  sinks) in place of the fused kernel: what mlx-lm's own ``kv_bits`` path
  would compute for the models it cannot run.

Bounds (all measured against ``fp``, the run without KV quantization, in the
same test; "error" is ``||a - b|| / ||b||`` of the logits, per step or over
the whole run). Numbers in brackets: these seeds, then the range over 6 model
seeds x other prompts (``bf16`` weights; gpt-oss runs in f32 on the CPU, whose
``gather_mm`` takes f32 only).

* Where stock runs (llama, qwen3): the two kv8 paths read the same quantized
  K/V and differ only in arithmetic (mlx-lm rounds scores and probabilities to
  bf16, mlxq accumulates in f32). So mlxq must
  (1) be no less accurate than stock: its whole-run error vs ``fp`` <= stock's
      [llama 0.0080 vs 0.0145, qwen3 0.0096 vs 0.0176; ratio 0.52-0.58];
  (2) differ from stock, at every step, by at most twice stock's largest
      per-step error vs ``fp`` [0.017 <= 0.036, 0.021 <= 0.044; 0.42-0.51 of
      the bound]: by the triangle inequality that is what two paths each
      within stock's own kv8 error of ``fp`` can differ by, so mlxq adds no
      error source beyond the quantization the user chose;
  (3) give the same argmax on >= 95% of steps [1.000, 0.984; 0.938-1.000: with
      random weights and 256 tokens, near-ties are common, and stock's bf16
      rounding moves them; mlxq agrees with ``fp`` at least as often].
* Where stock crashes (gemma3: sliding window; gpt-oss: sliding window +
  sinks; gemma4: sliding window + KV-shared layers), the yardstick is
  ``comp``, mlx-lm's own attention arithmetic on the same quantized caches:
  mlxq's error vs ``fp`` must be <= 1.1x comp's, over the run and at the worst
  step [gemma3 0.019 vs 0.026, gpt-oss 0.0131 vs 0.0131, gemma4 0.018 vs
  0.027; ratio 0.56-0.76 in bf16, 0.997-1.002 in f32, where both paths are
  exact up to f32 summation order: the 10% covers that]; its argmax agrees
  with ``fp`` on >= 90% of steps [0.984-1.000; 0.953-1.000].
"""

import importlib
import types

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as lm_base
from mlx_lm.models import cache as lm_cache
from support.helpers import assert_close, stock_or_skip
from support.lm import (
    BITS,
    CONTINUATION,
    GROUP,
    PREFILL_STEP,
    PROMPT_LEN,
    STOCK_CRASHES,
    STOCK_RUNS,
    argmax_agreement,
    baseline,
    lm_generate,
    run_error,
    runs,
    step_errors,
    teacher_forced,
    tokens,
)
from support.reference64 import sdpa64

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.random_models import random_model


@pytest.fixture(autouse=True)
def _restore_mlx_lm():
    yield
    mlxq_lm.disable()


# ------------------------------------------------------------ stock runs
@pytest.mark.parametrize("arch", STOCK_RUNS)
def test_kv8_logits_agree_with_mlx_lm_kv8(arch):
    r = runs(arch)
    fp, ours = r["fp"], r["mlxq"]
    assert np.isfinite(ours).all()
    # Every quantized attention call went through the fused kernel: only the
    # first prefill chunk (before the cache is quantized) used mx.fast.
    n_layers = len(random_model(arch)[0].layers)
    chunks = -(-(PROMPT_LEN - 1) // PREFILL_STEP)
    assert r["counts"] == {"mlx_lm": n_layers, "mlxq": n_layers * (chunks - 1 + CONTINUATION)}
    stock = baseline(r, "stock")

    stock_err = step_errors(stock, fp)
    assert run_error(ours, fp) <= run_error(stock, fp), (
        f"mlxq kv8 error vs unquantized {run_error(ours, fp):.3g} > stock kv8's "
        f"{run_error(stock, fp):.3g}"
    )
    bound = 2 * stock_err.max()
    diff = step_errors(ours, stock)
    assert diff.max() <= bound, (
        f"step {diff.argmax()}: mlxq vs stock kv8 {diff.max():.3g} > bound {bound:.3g} "
        f"(2 x stock's largest per-step error vs unquantized)"
    )
    assert argmax_agreement(ours, stock) >= 0.95


# ---------------------------------------------------------- stock crashes
@pytest.mark.parametrize("arch", STOCK_CRASHES)
def test_stock_kv_bits_crashes(arch):
    model, tokenizer = random_model(arch)
    with pytest.raises((NotImplementedError, ValueError)):
        lm_generate.generate(
            model, tokenizer, tokens(3, 40), max_tokens=4, kv_bits=BITS, quantized_kv_start=0
        )


@pytest.mark.parametrize("arch", STOCK_CRASHES)
def test_kv8_logits_stay_close_to_unquantized(arch):
    r = runs(arch)
    fp, ours = r["fp"], r["mlxq"]
    assert np.isfinite(ours).all()
    assert r["counts"]["mlxq"] > 0
    assert argmax_agreement(ours, fp) >= 0.90
    comp = baseline(r, "comp")
    assert run_error(ours, fp) <= 1.1 * run_error(comp, fp)
    ours_steps, comp_steps = step_errors(ours, fp), step_errors(comp, fp)
    assert ours_steps.max() <= 1.1 * comp_steps.max(), (
        f"largest per-step error vs unquantized {ours_steps.max():.3g} > 1.1 x "
        f"mlx-lm's composition's {comp_steps.max():.3g}"
    )


# ------------------------------------------------------------- rotated KV
@pytest.mark.parametrize("arch", STOCK_RUNS + STOCK_CRASHES)
def test_rotated_kv8_logits_stay_close_to_unquantized(arch):
    # enable(kv_hadamard=True): every cache mlxq quantizes stores Hadamard-rotated
    # rows, through sliding windows (gemma3, gpt-oss with sinks) and KV-shared
    # layers (gemma4, whose sharers get the donor's rotated triples).
    r = runs(arch)
    model, _ = random_model(arch, seed=1)
    prompt, cont = tokens(1, PROMPT_LEN), tokens(2, CONTINUATION)
    with mlxq_lm.enable(kv_hadamard=True):
        mlxq_lm.reset_counters()
        ours, cache = teacher_forced(model, prompt, cont, BITS)
        counts = mlxq_lm.counters()
    assert not mlxq_lm.settings().kv_hadamard  # disable() resets it
    quantized = [c for c in cache if hasattr(c, "bits")]
    assert quantized and all(c.hadamard for c in quantized)
    assert counts["mlxq"] > 0 and counts.get("mlx_lm", 0) == r["counts"].get("mlx_lm", 0)
    fp = r["fp"]
    assert np.isfinite(ours).all()
    assert argmax_agreement(ours, fp) >= 0.90
    # Random weights have no outlier channels for rotation to spread: it
    # should neither help nor hurt much.
    assert run_error(ours, fp) <= 1.5 * run_error(r["mlxq"], fp)


def test_rotated_kv_never_falls_back_to_mlx_lm():
    from mlxq.hadamard import quantize

    q = mx.zeros((1, 2, 1, 64))
    k = quantize(mx.ones((1, 2, 8, 64)), group_size=64, bits=4)
    with mlxq_lm.enabled():
        with pytest.raises(ValueError, match="Hadamard basis"):
            lm_base.scaled_dot_product_attention(q, k, k, None, scale=1.0, mask=object())
    with pytest.raises(ValueError, match="kv_hadamard must be a bool"):
        mlxq_lm.enable(kv_hadamard="yes")


# ------------------------------------------------------------- generation
@pytest.mark.parametrize("arch", STOCK_RUNS + STOCK_CRASHES)
def test_greedy_generation_returns_64_tokens(arch):
    model, tokenizer = random_model(arch)
    prompt = tokens(4, 70)
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        responses = list(
            lm_generate.stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=64,
                kv_bits=BITS,
                kv_group_size=GROUP,
                quantized_kv_start=0,
                prefill_step_size=32,
            )
        )
        assert mlxq_lm.counters()["mlxq"] > 0
        text = lm_generate.generate(
            model, tokenizer, prompt, max_tokens=8, kv_bits=4, quantized_kv_start=0
        )
    assert len(responses) == 64 and responses[-1].generation_tokens == 64
    assert responses[-1].finish_reason == "length"
    assert isinstance(text, str)
    # The greedy tokens are the argmax of a teacher-forced run over themselves,
    # on a cache quantized from the first token, as mlxq's generate_step makes it.
    generated = [r.token for r in responses]
    with mlxq_lm.enabled():
        cache = lm_cache.make_prompt_cache(model, kv_bits=BITS, kv_group_size=GROUP)
        logprobs, _ = teacher_forced(
            model, prompt, generated, BITS, cache=cache, step=32, logprobs=True
        )
    np.testing.assert_array_equal(logprobs.argmax(axis=1), generated)


def test_nothing_changes_without_kv_bits():
    model, tokenizer = random_model("gemma3")
    prompt, cont = tokens(5, 60), tokens(6, 16)
    stock, _ = teacher_forced(model, prompt, cont)
    stock_tokens = [
        r.token for r in lm_generate.stream_generate(model, tokenizer, prompt, max_tokens=16)
    ]
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        ours, cache = teacher_forced(model, prompt, cont)
        ours_tokens = [
            r.token for r in lm_generate.stream_generate(model, tokenizer, prompt, max_tokens=16)
        ]
        assert mlxq_lm.counters().get("mlxq", 0) == 0
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in cache)
    np.testing.assert_array_equal(ours, stock)
    assert ours_tokens == stock_tokens


def test_make_prompt_cache_with_kv_bits():
    model, _ = random_model("gemma3")
    with mlxq_lm.enabled():
        plain = lm_cache.make_prompt_cache(model)
        quantized = lm_cache.make_prompt_cache(model, kv_bits=4, kv_group_size=32)
    assert [type(c) for c in plain] == [type(c) for c in model.make_cache()]
    assert [type(c).__name__ for c in quantized] == [
        "Rotating" * (type(c).__name__ == "RotatingKVCache") + "QuantizedKVCache" for c in plain
    ]
    # (the recipe: 8-bit keys, 4-bit values, each at the group asked for)
    assert all((c.bits, c.v_bits) == (8, 4) and c.empty() for c in quantized)
    assert all(c.group_size == c.v_group_size == 32 for c in quantized)
    # Quantized from the first token: prefill runs on the fused kernel throughout.
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        model(mx.array([tokens(7, 40)]), cache=quantized)
        assert mlxq_lm.counters() == {"mlxq": len(model.layers)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_step_quantizes_from_the_first_chunk(arch):
    """With kv_bits and quantized_kv_start=0, generate_step's own cache is
    quantized before the first prefill chunk: every attention call, the first
    chunk's included, goes to mlxq (stock mlx-lm runs that chunk on bf16 and
    converts after it). A later quantized_kv_start keeps mlx-lm's rule."""
    model, _ = random_model(arch)
    prompt = mx.array(tokens(8, 100))
    layers = len(model.layers)
    # (kv_recent=0: the quantized buffers' writes alone; the window's ring is
    # test_the_windows_ring_copies_only_when_it_changes_shape's)
    with mlxq_lm.enable(kv_recent=0):
        mlxq_lm.reset_counters()
        mlxq._ext._take_ring_copies()
        out = [
            t
            for t, _ in lm_generate.generate_step(
                prompt,
                model,
                max_tokens=4,
                kv_bits=4,
                kv_group_size=GROUP,
                quantized_kv_start=0,
                prefill_step_size=32,
            )
        ]
        first = mlxq_lm.counters()
        # mlx-lm reads every cache's state after each chunk to evaluate it;
        # the caches are generate_step's own, so the writes stay in place.
        copies = mlxq._ext._take_ring_copies()
        mlxq_lm.reset_counters()
        list(
            lm_generate.generate_step(
                prompt,
                model,
                max_tokens=4,
                kv_bits=4,
                kv_group_size=GROUP,
                quantized_kv_start=64,
                prefill_step_size=32,
            )
        )
        later = mlxq_lm.counters()
    assert len(out) == 4
    # 99 prompt tokens in 4 chunks, then the last prompt token's step and 4
    # more (generate_step computes one token ahead of what it yields).
    assert first == {"mlxq": layers * (4 + 5)}, first
    assert copies == 0, f"{copies} cache writes copied their buffers"
    # Quantized once the offset reaches 64: chunks 1-2 (offsets 0, 32) on bf16.
    assert later.get("mlx_lm", 0) == 2 * layers and later["mlxq"] == 7 * layers, later


def test_the_windows_ring_copies_only_when_it_changes_shape():
    """Under generate_step the recipe's window writes its ring in place: it
    copies once per layer's K and V where the prefill's last fetch still
    holds it (the first decode step) and where the window first fills (the
    ring served in order becomes the ring served as laid out), never in
    steady decoding."""
    model, _ = random_model("llama")
    layers = len(model.layers)
    with mlxq_lm.enabled():
        mlxq._ext._take_ring_copies()
        copies = []
        steps = lm_generate.generate_step(
            mx.array(tokens(8, 100)), model, max_tokens=60, kv_bits=4, prefill_step_size=32
        )
        for _ in steps:
            copies.append(mlxq._ext._take_ring_copies())
    assert sum(copies) <= 4 * layers, copies
    assert sum(copies[30:]) == 0, copies  # steady decoding past the fill at 128 tokens


def _quantized_cache_and_kv(rng_seed, Hq=8, Hkv=2, L=1, N=40, D=64, bits=BITS):
    mx.random.seed(rng_seed)
    cache = lm_cache.QuantizedKVCache(group_size=GROUP, bits=bits)
    k, v = (mx.random.normal((1, Hkv, N, D)).astype(mx.bfloat16) for _ in range(2))
    keys, values = cache.update_and_fetch(k, v)
    q = mx.random.normal((1, Hq, L, D)).astype(mx.bfloat16)
    return q, keys, values, cache


def test_sinks_over_quantized_kv_go_to_mlxq():
    q, keys, values, cache = _quantized_cache_and_kv(0)
    sinks = mx.random.normal((8,))
    with pytest.raises(ValueError, match="sinks"):  # stock refuses
        lm_base.scaled_dot_product_attention(q, keys, values, cache, 0.125, None, sinks=sinks)
    expected = sdpa64(q, keys, values, scale=0.125, sinks=sinks, group_size=GROUP, bits=BITS)
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        got = lm_base.scaled_dot_product_attention(q, keys, values, cache, 0.125, None, sinks=sinks)
        assert mlxq_lm.counters() == {"mlxq": 1}
    assert_close(got, expected)  # TOL's bound vs the float64 oracle


def test_shared_quantized_kv_without_cache_goes_to_mlxq():
    # Gemma 3n/4 KV-shared layers pass a donor's quantized tuples with cache=None.
    q, keys, values, cache = _quantized_cache_and_kv(1, L=5, bits=4)
    with pytest.raises((ValueError, TypeError)):  # stock hands the tuples to mx.fast
        lm_base.scaled_dot_product_attention(q, keys, values, None, 0.125, "causal")
    expected = sdpa64(q, keys, values, scale=0.125, mask="causal", group_size=GROUP, bits=4)
    with mlxq_lm.enabled():
        got = lm_base.scaled_dot_product_attention(q, keys, values, None, 0.125, "causal")
    assert_close(got, expected)


def test_unsupported_shapes_fall_back_to_mlx_lm():
    # Head dim 576 is beyond mlxq's kernels (<= 512): mlx-lm's composition runs.
    q = mx.random.normal((1, 4, 3, 576)).astype(mx.bfloat16)
    k = tuple(mx.quantize(mx.random.normal((1, 2, 9, 576)).astype(mx.bfloat16), 64, 8))
    v = tuple(mx.quantize(mx.random.normal((1, 2, 9, 576)).astype(mx.bfloat16), 64, 8))
    # (fresh copies of q: mlx-lm's composition scales its queries in place)
    expected = stock_or_skip(
        lm_base.quantized_scaled_dot_product_attention, mx.array(q), k, v, 0.1, "causal", 64, 8
    )
    with mlxq_lm.enabled():
        mlxq_lm.reset_counters()
        got = lm_base.quantized_scaled_dot_product_attention(
            mx.array(q), k, v, 0.1, "causal", 64, 8
        )
        assert mlxq_lm.counters() == {"mlx_lm": 1}
    assert mx.array_equal(got, expected)


# ----------------------------------------------------------- prompt caches
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_saved_prompt_cache_loads_and_continues_identically(arch, tmp_path):
    model, tokenizer = random_model(arch)
    prompt, cont = tokens(8, 90), tokens(9, 24)
    path = str(tmp_path / "prompt.safetensors")
    # (kv_recent=0: a file holds every token quantized, not the recipe's exact
    # window, so only caches without one continue identically after a load)
    with mlxq_lm.enable(kv_recent=0):
        cache = lm_cache.make_prompt_cache(model)
        for chunk in (prompt[:50], prompt[50:]):
            model(mx.array([chunk]), cache=cache)
            lm_generate.maybe_quantize_kv_cache(cache, 0, GROUP, 4)
        mx.eval([c.state for c in cache])
        lm_cache.save_prompt_cache(path, cache, {"model": arch})
        loaded, meta = lm_cache.load_prompt_cache(path, return_metadata=True)
        ours_loaded = mlxq.load_prompt_cache(path)
        assert meta == {"model": arch}
        assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in cache]
        if arch == "gemma3":
            assert any(isinstance(c, mlxq.RotatingQuantizedKVCache) for c in loaded)
        first = teacher_forced(model, [cont[0]], cont[1:], 4, cache=cache)[0]
        again = teacher_forced(model, [cont[0]], cont[1:], 4, cache=loaded)[0]
        third = teacher_forced(model, [cont[0]], cont[1:], 4, cache=ours_loaded)[0]
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(third, first)
        # And through mlx-lm's generate, from a freshly loaded copy each time.
        gen = [
            [
                r.token
                for r in lm_generate.stream_generate(
                    model,
                    tokenizer,
                    cont[:3],
                    max_tokens=12,
                    kv_bits=4,
                    quantized_kv_start=0,
                    prompt_cache=lm_cache.load_prompt_cache(path),
                )
            ]
            for _ in range(2)
        ]
        assert gen[0] == gen[1] and len(gen[0]) == 12
    if arch == "gemma3":  # mlx-lm knows the class only while mlxq is enabled
        with pytest.raises(KeyError):
            lm_cache.load_prompt_cache(path)


# ------------------------------------------------------------- enable/disable
def _snapshot():
    import sys

    return {
        name: dict(vars(m))
        for name, m in list(sys.modules.items())
        if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))
    }


def test_enable_disable_restores_mlx_lm_exactly():
    import sys

    import mlx_lm.models.llama as lm_llama

    mlxq_lm.disable()
    before = _snapshot()
    originals = (
        lm_base.scaled_dot_product_attention,
        lm_base.quantized_scaled_dot_product_attention,
        lm_cache.make_prompt_cache,
        lm_generate.maybe_quantize_kv_cache,
    )
    handle = mlxq_lm.enable()
    assert mlxq_lm.is_enabled()
    assert mlxq_lm.enable()._owns is False  # idempotent
    assert lm_base.scaled_dot_product_attention is mlxq_lm.scaled_dot_product_attention
    assert lm_llama.scaled_dot_product_attention is mlxq_lm.scaled_dot_product_attention
    assert (
        lm_base.quantized_scaled_dot_product_attention
        is mlxq_lm.quantized_scaled_dot_product_attention
    )
    assert lm_cache.make_prompt_cache is mlxq_lm.make_prompt_cache
    assert lm_generate.make_prompt_cache is mlxq_lm.make_prompt_cache
    assert lm_generate.maybe_quantize_kv_cache is mlxq_lm.maybe_quantize_kv_cache
    assert lm_cache.RotatingQuantizedKVCache is mlxq.RotatingQuantizedKVCache
    # A model module first imported while enabled binds mlxq's dispatch ...
    fresh_name = next(
        n
        for n in ("mlx_lm.models.olmo2", "mlx_lm.models.starcoder2", "mlx_lm.models.stablelm")
        if n not in sys.modules
    )
    fresh = importlib.import_module(fresh_name)
    assert fresh.scaled_dot_product_attention is mlxq_lm.scaled_dot_product_attention
    with handle:
        pass  # the owning handle disables on exit
    assert not mlxq_lm.is_enabled()
    # ... and gets mlx-lm's back on disable, like everything else.
    assert fresh.scaled_dot_product_attention is originals[0]
    after = _snapshot()
    for name, attrs in before.items():
        now = after[name]
        missing = attrs.keys() - now.keys()
        added = [
            a for a in now.keys() - attrs.keys() if not isinstance(now[a], types.ModuleType)
        ]  # (the fresh import)
        changed = [a for a in attrs if a in now and now[a] is not attrs[a]]
        assert not (missing or added or changed), f"{name}: {missing} {added} {changed}"
    ours = {
        id(f)
        for f in (
            mlxq_lm.scaled_dot_product_attention,
            mlxq_lm.quantized_scaled_dot_product_attention,
            mlxq_lm.make_prompt_cache,
            mlxq_lm.maybe_quantize_kv_cache,
        )
    }
    leftovers = [(n, a) for n, attrs in after.items() for a, v in attrs.items() if id(v) in ours]
    assert not leftovers
    assert (
        lm_base.scaled_dot_product_attention,
        lm_base.quantized_scaled_dot_product_attention,
        lm_cache.make_prompt_cache,
        lm_generate.maybe_quantize_kv_cache,
    ) == originals
    # The context-manager forms.
    with mlxq_lm.enabled():
        assert mlxq_lm.is_enabled()
        with mlxq_lm.enabled():  # nested: the outer block keeps it on
            pass
        assert mlxq_lm.is_enabled()
    assert not mlxq_lm.is_enabled()
    mlxq_lm.disable()  # idempotent
    assert not mlxq_lm.is_enabled()


# ----------------------------------------------------------- the command line
def test_cli_random_model_quantized(capsys):
    from mlxq.generate import main

    main(
        [
            "--random-model",
            "gemma3",
            "--kv-bits",
            "4",
            "--max-tokens",
            "8",
            "--prompt",
            "abc",
            "--prompt-tokens",
            "300",
            "--prefill-step-size",
            "128",
        ]
    )
    out, err = capsys.readouterr()
    assert "Generation: 8 tokens" in out and "Prompt: 300 tokens" in out
    assert "Peak memory:" in out
    assert "RotatingQuantizedKVCache(K 8-bit group 64, V 4-bit group 64)" in out  # the recipe
    assert "prefill [" in err and "300/300 tokens" in err
    assert not mlxq_lm.is_enabled()


def test_cli_kv_rotate(capsys):
    from mlxq.generate import main

    args = ["--random-model", "llama", "--max-tokens", "4", "--prompt-tokens", "40"]
    main(args + ["--kv-bits", "4", "--kv-hadamard"])
    out, _ = capsys.readouterr()
    assert "Generation: 4 tokens" in out and not mlxq_lm.settings().kv_hadamard
    with pytest.raises(SystemExit):
        main(args + ["--kv-hadamard"])  # without --kv-bits


def test_cli_local_model_directory_and_prompt_cache(tmp_path, capsys):
    from mlxq.generate import main
    from mlxq.random_models import save_random_model

    path = save_random_model(str(tmp_path / "model"), "qwen3")
    # qwen3 has no make_cache: --max-kv-size gives mlx-lm's RotatingKVCache,
    # which kv_bits turns into mlxq's RotatingQuantizedKVCache.
    main(
        [
            "--model",
            path,
            "--kv-bits",
            "8",
            "--max-kv-size",
            "64",
            "--max-tokens",
            "6",
            "--prompt",
            "hello",
            "--prompt-tokens",
            "100",
            "--quantized-kv-start",
            "20",
        ]
    )
    out, _ = capsys.readouterr()
    assert "Generation: 6 tokens" in out
    assert "RotatingQuantizedKVCache(8-bit, group 64)" in out

    from mlx_lm.utils import load

    model, _ = load(path)
    cache_file = str(tmp_path / "prompt.safetensors")
    with mlxq_lm.enabled():
        cache = lm_cache.make_prompt_cache(model, 64, kv_bits=8)
        model(mx.array([tokens(10, 80)]), cache=cache)
        lm_cache.save_prompt_cache(cache_file, cache, {"model": path})
    main(
        [
            "--prompt-cache-file",
            cache_file,
            "--kv-bits",
            "8",
            "--max-tokens",
            "5",
            "--prompt",
            "more",
        ]
    )
    out, _ = capsys.readouterr()
    assert "Generation: 5 tokens" in out and "Prompt: 4 tokens" in out
