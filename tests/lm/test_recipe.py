"""The 4-bit recipe's keys: ``kv_bits=4`` under a bare ``enable()`` stores
8-bit keys beside 4-bit values (with the window, tests/caches/
test_recent_window.py), ``k_bits`` sets the keys by name, and explicit
settings (``v_bits``, ``kv_layers``, MLA latents) pass the recipe by."""

import importlib

import mlx.core as mx
import pytest

import mlxq.mlx_lm as mlxq_lm
from mlxq.kv_spec import parse_spec
from mlxq.mlx_lm.caches import quantize_caches
from mlxq.mlx_lm.settings import RECIPE_K_BITS, Settings
from mlxq.random_models import random_model

# The module (the mlx_lm package's `generate` attribute is the function).
lm_generate = importlib.import_module("mlx_lm.generate")


def formats(caches):
    """(keys' bits, values' bits, values' group, window) of each cache."""
    return {(c.bits, c.format.v_bits, c.format.v_group_size, c.recent) for c in caches}


@pytest.mark.parametrize(
    "bits, options, want",
    [
        (4, {}, (RECIPE_K_BITS, 4, 64, 128)),  # the recipe
        (4, dict(k_bits=4), (4, 4, 64, 128)),  # its keys turned off by name
        (4, dict(k_bits=4, kv_recent=0), (4, 4, 64, 0)),  # the whole recipe off
        (4, dict(kv_recent=0), (8, 4, 64, 0)),  # the keys without the window
        (4, dict(v_bits=2), (4, 2, 64, 128)),  # a value width names the pair
        (4, dict(v_group_size=32), (8, 4, 32, 128)),
        (3, {}, (3, 3, 64, 128)),  # below 4 bits: the window alone
        (2, dict(k_bits=8), (8, 2, 64, 128)),
        (8, {}, (8, 8, 64, 0)),  # 8 bits stay as they are
        (8, dict(k_bits=4), (4, 8, 64, 0)),
    ],
)
def test_kv_bits_gets_the_recipes_keys(bits, options, want):
    model, _ = random_model("llama", seed=2)
    with mlxq_lm.enable(**options):
        from mlx_lm.models.cache import make_prompt_cache  # (enable() replaces it)

        caches = make_prompt_cache(model, kv_bits=bits)
    assert formats(caches) == {want}


def test_the_recipe_by_name_is_what_kv_bits_4_gets():
    """``recipe`` (mlxq-fidelity --kv, kv_layers) names the caches a bare
    ``enable()`` gives ``kv_bits=4``."""
    f, opts = parse_spec("recipe").format, Settings().cache_options(64, 4)
    named = (f.group_size, f.bits, f.v_group_size, f.v_bits, f.hadamard)
    v_group = opts["v_group_size"] or opts["group_size"]  # None: the keys' group
    assert named == (64, opts["bits"], v_group, opts["v_bits"], opts["hadamard"])
    assert parse_spec("recipe").recent == Settings().recent_for(4)


def test_the_recipe_reaches_batch_caches_and_rings():
    """A BatchGenerator's caches (Gemma 3: full-attention caches and
    sliding-window rings) store the recipe's keys."""
    model, _ = random_model("gemma3", seed=5, dtype=mx.float32)
    with mlxq_lm.enable():
        gen = lm_generate.BatchGenerator(model, kv_bits=4, completion_batch_size=4)
        gen.insert([[1, 2, 3, 4, 5], [7, 8, 9]], [2, 2])
        gen.next_generated()
        caches = gen._generation_batch.prompt_cache
        gen.close()
    kinds = {type(c).__name__ for c in caches}
    assert kinds == {"BatchQuantizedKVCache", "BatchRotatingQuantizedKVCache"}
    assert {(c.bits, c.format.v_bits) for c in caches} == {(RECIPE_K_BITS, 4)}


def test_kv_layers_entries_are_explicit():
    """A ``kv_layers`` setting names its keys: "4" stays 4-bit where the
    recipe would give the other caches 8-bit keys."""
    model, _ = random_model("llama", seed=2)
    caches = [c for c in mlxq_lm.make_prompt_cache(model)]
    for c in caches:
        c.update_and_fetch(mx.zeros((1, 4, 3, 64)), mx.zeros((1, 4, 3, 64)))
    quantize_caches(caches, 0, 64, 4, Settings(kv_layers=((0, parse_spec("4")),)))
    assert (caches[0].bits, caches[0].format.v_bits, caches[0].recent) == (4, 4, 0)
    assert formats(caches[1:]) == {(RECIPE_K_BITS, 4, 64, 128)}


def test_the_recipe_decodes_what_its_caches_hold():
    """Greedy tokens with the recipe equal those of caches built as
    ``kv_bits=8, v_bits=4`` with the window: the recipe is that pair."""
    model, _ = random_model("llama", seed=3)
    prompt = mx.array([5, 9, 13, 2, 7, 11, 3] * 6)

    def greedy(bits, **options):
        with mlxq_lm.enable(**options):
            steps = lm_generate.generate_step(
                prompt, model, max_tokens=8, kv_bits=bits, quantized_kv_start=0
            )
            return [int(t) for t, _ in steps]

    assert greedy(4) == greedy(8, v_bits=4, kv_recent=128)


def test_the_setting_printed_names_the_recipes_parts(capsys):
    from mlxq.generate import main

    args = ["--random-model", "llama", "--max-tokens", "2", "--prompt-tokens", "20"]
    main(args + ["--kv-bits", "4"])
    err = capsys.readouterr().err
    assert "8-bit K (group 64), 4-bit V (group 64)" in err, err
    assert "--k-bits 4 turns them off" in err and "--kv-recent 0 turns it off" in err, err
    main(args + ["--kv-bits", "4", "--k-bits", "4"])
    err = capsys.readouterr().err
    assert "4-bit, group 64" in err and "--k-bits" not in err, err
    with pytest.raises(SystemExit):
        main(args + ["--k-bits", "4"])  # without --kv-bits
    assert "k_bits=4 turns them off" in Settings().describe(4, 64)


@pytest.mark.parametrize("bad", [5.0, True, 9, "8"])
def test_k_bits_is_checked(bad):
    with pytest.raises(ValueError, match="k_bits must be one of"):
        mlxq_lm.enable(k_bits=bad)
    mlxq_lm.disable()
