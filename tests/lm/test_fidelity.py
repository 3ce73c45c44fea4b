"""mlxq.fidelity: the setting grammar, and measurements that must hold on
any model (a random-weight llama here; the packaged trained models run in
tests/models/test_fidelity_models.py)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache

from mlxq import fidelity
from mlxq.evaluate import teacher_forced
from mlxq.fidelity.__main__ import main
from mlxq.random_models import random_model


@pytest.mark.parametrize(
    "text,label,fmt,recent",
    [
        ("4", "4", (64, 4, 64, 4, False), 0),
        ("4g32", "4g32", (32, 4, 32, 4, False), 0),
        ("8/4", "8/4", (64, 8, 64, 4, False), 0),
        ("8g128/4g32", "8g128/4g32", (128, 8, 32, 4, False), 0),
        ("4+hadamard", "4+hadamard", (64, 4, 64, 4, True), 0),
        ("4+recent128+hadamard", "4+hadamard+recent128", (64, 4, 64, 4, True), 128),
        (" recipe", "8/4+recent128", (64, 8, 64, 4, False), 128),
    ],
)
def test_settings_parse(text, label, fmt, recent):
    spec = fidelity.parse_spec(text)
    f = spec.format
    assert (f.group_size, f.bits, f.v_group_size, f.v_bits, f.hadamard) == fmt
    assert spec.recent == recent and spec.label == label
    assert fidelity.parse_spec(spec.label) == spec


@pytest.mark.parametrize(
    "text",
    ["", "four", "4g", "4+recent", "4+rot", "7", "4g48", "4+hadamard+hadamard", "recipe+hadamard"],
)
def test_bad_settings_name_the_grammar(text):
    with pytest.raises(ValueError, match="mlxq"):
        fidelity.parse_spec(text)


@pytest.fixture(scope="module")
def llama():
    model, _ = random_model("llama", seed=2, dtype=mx.float32)
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 255, 200)]
    return model, ids


def test_measurements(llama):
    model, ids = llama
    specs = [fidelity.parse_spec(s) for s in ("8", "2", "2+recent64")]
    seen = []
    result = fidelity.measure(model, ids, specs, chunk=48, per_layer=specs[1], progress=seen.append)
    ref, kv8, kv2, kv2r = result["settings"]
    # The reference run is mlx-lm's own teacher-forced perplexity.
    want, _ = teacher_forced(model, ids, lm_cache.make_prompt_cache(model), chunk=48)
    assert ref["setting"] == "unquantized" and ref["perplexity"] == pytest.approx(want, rel=1e-5)
    assert sum(seen) == len(ids) - 1
    # More bits, closer to unquantized; an exact window brings 2-bit back.
    assert 0 < kv8["kl_mean"] < kv2r["kl_mean"] < kv2["kl_mean"]
    assert kv8["flip_rate"] <= kv2["flip_rate"] and 0 < kv2["flip_rate"] <= 1
    assert kv2["kl_p99"] >= kv2["kl_mean"]
    assert kv8["bits_per_element"] == 8.5 and kv2["bits_per_element"] == 2.5
    assert kv2r["bits_per_element"] == pytest.approx(2.5 + 16 * 64 / len(ids))
    assert all(r["quantized_caches"] == "4/4" for r in (kv8, kv2, kv2r))
    layers = result["per_layer"]["layers"]
    assert [r["layer"] for r in layers] == [0, 1, 2, 3]
    assert all(r["quantized_caches"] == "1/4" for r in layers)
    # One layer at 2 bits moves the distribution less than all four.
    assert all(0 < r["kl_mean"] < kv2["kl_mean"] for r in layers)


def test_a_mixed_setting_measures_its_caches_at_their_own_settings(llama):
    """A base setting with per-cache ones (enable(kv_layers=...)): all 2-bit
    but one cache 8-bit lands between all 2-bit and all 8-bit, at the
    caches' mean bits per element; every cache 8-bit equals uniform 8-bit."""
    model, ids = llama
    two, eight = fidelity.parse_spec("2"), fidelity.parse_spec("8")
    one = fidelity.measure(model, ids, [two, eight], chunk=48, mixed=(two, {1: eight}))
    kv2, kv8, mix = one["settings"][1:]
    assert mix["setting"] == "2 with 1 caches at 8"
    assert mix["bits_per_element"] == pytest.approx((3 * 2.5 + 8.5) / 4)
    assert kv8["kl_mean"] < mix["kl_mean"] < kv2["kl_mean"]
    every = fidelity.measure(
        model, ids, [eight], chunk=48, mixed=(two, dict.fromkeys(range(4), eight))
    )
    assert every["settings"][2]["kl_mean"] == pytest.approx(every["settings"][1]["kl_mean"])
    with pytest.raises(ValueError, match="cache 9"):
        fidelity.measure(model, ids, [], mixed=(two, {9: eight}))


def test_cli_writes_json_and_a_table(tmp_path, capsys, monkeypatch):
    # The CLI on a random model saved as an mlx-lm folder.
    from mlxq.random_models import save_random_model

    folder = tmp_path / "model"
    save_random_model(str(folder), "llama", seed=1)
    out = tmp_path / "f.json"
    rc = main(
        [
            str(folder),
            "--kv",
            "8",
            "4+recent32",
            "--tokens",
            "120",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "4+recent32" in printed and "KL mean" in printed
    result = json.loads(out.read_text())
    assert [r["setting"] for r in result["settings"]] == ["unquantized", "8", "4+recent32"]
    assert result["tokens"] == 120


def test_cli_refuses_what_it_cannot_read(capsys):
    assert main(["no-such-model"]) == 2
    assert "not a packaged model" in capsys.readouterr().err
    assert main(["smollm2-135m", "--kv", "4+rot"]) == 2
    assert "is not K[gG]" in capsys.readouterr().err
