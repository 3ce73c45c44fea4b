"""Names bound to mlx-lm's functions before mlxq.mlx_lm.enable() (a user's
``from mlx_lm.generate import generate_step``) keep mlx-lm's own behaviour:
enable() warns once for each, naming it."""

import importlib
import pathlib
import sys
import types
import warnings

import pytest

import mlxq.mlx_lm as mlxq_lm

# The module: the mlx_lm package's `generate` attribute is the function.
lm_generate = importlib.import_module("mlx_lm.generate")


@pytest.fixture
def early_module():
    mlxq_lm.disable()
    mod = types.ModuleType("user_script_for_test")
    mod.generate_step = lm_generate.generate_step  # bound before enable()
    mod.BatchGenerator = lm_generate.BatchGenerator
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]
    mlxq_lm.disable()


def test_enable_warns_once_per_early_binding(early_module):
    with pytest.warns(UserWarning) as caught:
        mlxq_lm.enable()
    messages = [str(w.message) for w in caught if "user_script_for_test" in str(w.message)]
    assert any("user_script_for_test.generate_step" in m for m in messages), messages
    assert any("user_script_for_test.BatchGenerator" in m for m in messages), messages
    assert all("mlx_lm.generate." in m and "after enable()" in m for m in messages)
    mlxq_lm.disable()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        mlxq_lm.enable()
    assert not [w for w in again if "user_script_for_test" in str(w.message)]


def test_names_bound_after_enable_do_not_warn():
    mlxq_lm.disable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mlxq_lm.enabled():
            from mlx_lm.generate import generate_step  # noqa: F401
    assert not [w for w in caught if "bound before" in str(w.message)]


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "dev"])
def test_enable_names_the_supported_mlx_lm_range(version):
    with pytest.raises(RuntimeError, match=r"mlx-lm >=0\.32\.0,<0\.33, found"):
        mlxq_lm.check_mlx_lm_version(version)


def test_the_installed_mlx_lm_is_supported_and_pinned():
    import mlx_lm

    mlxq_lm.check_mlx_lm_version(mlx_lm.__version__)
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"mlx-lm{mlxq_lm.MLX_LM_RANGE}"' in pyproject


def test_enable_refuses_an_untested_mlx_lm(monkeypatch):
    import mlx_lm

    mlxq_lm.disable()
    monkeypatch.setattr(mlx_lm, "__version__", "0.33.1")
    with pytest.raises(RuntimeError, match="found 0.33.1"):
        mlxq_lm.enable()
    assert not mlxq_lm.is_enabled()


def test_settings_are_one_frozen_value_replaced_whole():
    import dataclasses

    from mlxq.mlx_lm.settings import DEFAULT, Settings

    mlxq_lm.disable()
    assert mlxq_lm.settings() is DEFAULT
    with mlxq_lm.enable(kv_hadamard=True, kv_recent=16):
        first = mlxq_lm.settings()
        assert first == Settings(kv_hadamard=True, kv_recent=16)
        with pytest.raises(dataclasses.FrozenInstanceError):
            first.kv_hadamard = False
        mlxq_lm.enable(v_bits=4)  # already enabled: the options still apply
        assert mlxq_lm.settings() == Settings(kv_hadamard=True, kv_recent=16, v_bits=4)
        assert first.v_bits is None  # the earlier value is unchanged
    assert mlxq_lm.settings() is DEFAULT


def test_a_batch_generator_keeps_the_settings_it_was_built_with():
    from mlxq.random_models import random_model

    model, _ = random_model("llama", seed=1)
    with mlxq_lm.enable(kv_hadamard=True):
        gen = lm_generate.BatchGenerator(model, kv_bits=4)
        mlxq_lm.enable(kv_hadamard=False)
        assert gen.settings.kv_hadamard and not mlxq_lm.settings().kv_hadamard


def test_mlxqs_functions_serve_calls_before_any_enable():
    """mlxq.mlx_lm's own make_prompt_cache and generate_step call mlx-lm's
    functions under them; in a process that never enabled mlxq they are
    mlx-lm's module attributes (a fresh interpreter: this one has enabled).
    The model's attention is mlx-lm's there, so the step runs on its caches."""
    import subprocess

    script = (
        "import mlx.core as mx, mlxq.mlx_lm as m\n"
        "from mlxq.random_models import random_model\n"
        "model, _ = random_model('llama', seed=1)\n"
        "c = m.make_prompt_cache(model, kv_bits=4)\n"
        "assert type(c[0]).__name__ == 'QuantizedKVCache', type(c[0])\n"
        "steps = m.generate_step(mx.array([1, 2, 3]), model, max_tokens=2)\n"
        "assert len([t for t, _ in steps]) == 2\n"
        "assert not m.is_enabled()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
