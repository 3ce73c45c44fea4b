"""enable(kv_layers=...): chosen caches quantized otherwise than kv_bits says,
from a mapping or from the JSON file mlxq-fidelity --write-layers writes."""

import importlib
import json

import mlx.core as mx
import pytest

import mlxq.mlx_lm as mlxq_lm
from mlxq.fidelity.__main__ import main as fidelity
from mlxq.random_models import random_model, save_random_model

lm_generate = importlib.import_module("mlx_lm.generate")


@pytest.fixture(scope="module")
def model():
    return random_model("llama", seed=4, dtype=mx.float32)[0]


def formats(cache):
    return [(c.bits, c.v_bits, c.hadamard, c.recent) for c in cache]


def greedy(model, **kw):
    cache = mlxq_lm.make_prompt_cache(model, kv_bits=kw.get("kv_bits"))
    steps = lm_generate.generate_step(
        mx.array([3, 1, 4, 1, 5, 9, 2, 6]), model, prompt_cache=cache, max_tokens=6, **kw
    )
    return [int(t) for t, _ in steps], cache


def test_each_named_cache_gets_its_own_setting(model):
    with mlxq_lm.enable(kv_layers={0: "8", 2: "8/4+hadamard", "3": 2}):
        mlxq_lm.reset_counters()
        _, cache = greedy(model, kv_bits=4, quantized_kv_start=0)
        # The base setting (kv_bits=4) gets the recipe (8-bit keys, the
        # window); each kv_layers entry is its cache's whole setting.
        assert formats(cache) == [
            (8, 8, False, 0),
            (8, 4, False, 128),
            (8, 4, True, 0),
            (2, 2, False, 0),
        ]
        assert mlxq_lm.counters().get("mlx_lm", 0) == 0
    assert mlxq_lm.settings().kv_layers == ()  # disable() resets them


def test_layers_alone_do_not_quantize(model):
    with mlxq_lm.enable(kv_layers={1: "8"}):
        _, cache = greedy(model)
        assert not any(hasattr(c, "bits") for c in cache)


def test_a_window_for_one_layer(model):
    with mlxq_lm.enable(kv_layers={1: "4+recent4"}, kv_recent=0):
        got, cache = greedy(model, kv_bits=4, quantized_kv_start=0)
        assert [c.recent for c in cache] == [0, 4, 0, 0] and len(got) == 6


def test_batches_keep_each_layers_setting(model):
    tokenizer = random_model("llama")[1]
    with mlxq_lm.enable(kv_layers={0: "8", 3: "8/4"}):
        out = lm_generate.batch_generate(
            model,
            tokenizer,
            [[5, 6, 7], [9, 10, 11, 12, 13]],
            max_tokens=5,
            kv_bits=4,
            return_prompt_caches=True,
        )
        for cache in out.caches:
            assert [(c.bits, c.v_bits) for c in cache] == [(8, 8), (8, 4), (8, 4), (8, 4)]


@pytest.mark.parametrize(
    "layers,match",
    [
        ({-1: "8"}, "not a cache index"),
        ({"x": "8"}, "not a cache index"),
        ({0: "9"}, "bits must be one of"),
        ({0: "four"}, "is not K"),
        ({0: 4.5}, "must be a KV setting"),
        ([0, 8], "must map cache indices"),
        ("/no/such/file.json", "is not JSON"),
    ],
)
def test_bad_layers_name_the_entry(layers, match):
    with pytest.raises(ValueError, match=match):
        mlxq_lm.enable(kv_layers=layers)
    mlxq_lm.disable()


def test_a_cache_the_model_lacks(model):
    with mlxq_lm.enable(kv_layers={7: "8"}):
        with pytest.raises(ValueError, match="names cache 7, but this model's prompt cache has 4"):
            greedy(model, kv_bits=4, quantized_kv_start=0)


def test_fidelity_writes_the_file_enable_reads(model, tmp_path):
    folder = save_random_model(str(tmp_path / "m"), "llama", seed=4)
    layers = tmp_path / "layers.json"
    argv = [folder, "--kv", "4", "--tokens", "100", "--per-layer", "2", "--protect", "1"]
    argv += ["--write-layers", str(layers), "--out", str(tmp_path / "f.json"), "--no-progress"]
    assert fidelity(argv) == 0
    written = json.loads(layers.read_text())
    per_layer = json.loads((tmp_path / "f.json").read_text())["per_layer"]["layers"]
    worst = max(per_layer, key=lambda r: r["kl_mean"])["layer"]
    assert written == {"kv_layers": {str(worst): "8"}, "ranked_by": "2"}
    with mlxq_lm.enable(kv_layers=str(layers), k_bits=4):  # (4-bit keys elsewhere)
        _, cache = greedy(model, kv_bits=4, quantized_kv_start=0)
        assert [c.bits for c in cache] == [8 if i == worst else 4 for i in range(4)]
