"""mlxq's one environment reader (csrc/environment.cpp): what it parses, its
test hooks, and that nothing else in the package reads MLXQ_* variables."""

import json
import os
import pathlib
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from support.helpers import random_inputs

import mlxq

ROOT = pathlib.Path(__file__).resolve().parents[2]


def read_in_child(env):
    code = "import mlxq, json; print(json.dumps(mlxq._ext._environment()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_variables_are_parsed_once_at_start():
    names = set(mlxq._ext._environment())
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_")}
    defaults = read_in_child({})
    assert defaults["MLXQ_CPU_INT"] == "" or "MLXQ_CPU_INT" in os.environ
    switches = [n for n in names if n not in ("MLXQ_NUM_THREADS", "MLXQ_CPU_INT")]
    assert all(defaults[n] == "1" for n in switches if n not in os.environ), defaults
    off = read_in_child({**clean, **{n: "0" for n in switches}, "MLXQ_NUM_THREADS": "3"})
    assert all(off[n] == "0" for n in switches), off
    assert off["MLXQ_NUM_THREADS"] == "3"
    # Any value but 0 leaves a switch on: one spelling, "0", turns each off.
    on = read_in_child({**clean, **{n: "yes" for n in switches}})
    assert all(on[n] == "1" for n in switches), on


def test_unknown_names_raise(set_env):
    with pytest.raises(ValueError, match="MLXQ_NOT_A_SWITCH"):
        set_env("MLXQ_NOT_A_SWITCH", "0")
    with pytest.raises(ValueError, match="known: .*split_tasks_per_thread"):
        mlxq._ext._set_tuning("not_a_tuning_field", 1)


def test_cpu_int_switch_takes_effect_per_call(set_env):
    if mx.default_device() != mx.cpu:
        pytest.skip("MLXQ_CPU_INT chooses the CPU kernel's products")
    set_env("MLXQ_CPU_INT", "0")
    assert mlxq._ext._cpu_int_kernels() is None
    set_env("MLXQ_CPU_INT", "1")
    assert mlxq._ext._environment()["MLXQ_CPU_INT"] == ""


def test_split_tuning_changes_no_result(rng):
    """The CPU key splits are a schedule: the same output with and without."""
    if mx.default_device() != mx.cpu:
        pytest.skip("split_tasks_per_thread tunes the CPU kernel")
    q, k, v = random_inputs(rng, Hq=8, Hkv=8, L=1, N=4096, bits=4, group_size=64)
    outs = []
    for n in (4, 0):
        mlxq._ext._set_tuning("split_tasks_per_thread", n)
        try:
            outs.append(np.array(mlxq.sdpa(q, k, v, scale=0.1)))
        finally:
            mlxq._ext._set_tuning("split_tasks_per_thread", 4)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_one_reader():
    """getenv appears only in csrc/environment.cpp; the Python package reads
    no MLXQ_* variable but the model cache's folder."""
    readers = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "csrc").rglob("*")
        if p.is_file() and "getenv" in p.read_text(errors="ignore")
    ]
    assert readers == ["csrc/environment.cpp"], readers
    python_reads = {
        (str(p.relative_to(ROOT)), name)
        for p in (ROOT / "python" / "mlxq").rglob("*.py")
        for name in re.findall(r"environ(?:\.get)?\(?\[?\"(MLXQ_\w+)", p.read_text())
    }
    assert python_reads <= {("python/mlxq/gguf.py", "MLXQ_CACHE")}, python_reads
