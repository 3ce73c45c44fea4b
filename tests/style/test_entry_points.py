"""The console scripts in pyproject.toml exist, run, and match `python -m`."""

import importlib
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# [project.scripts]'s `name = "module:function"` lines (tomllib is 3.11+).
_BLOCK = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', _BLOCK, re.M))


@pytest.fixture(autouse=True)
def device():
    yield None


def test_the_commands_are_declared():
    assert set(SCRIPTS) == {"mlxq-fidelity", "mlxq-generate", "mlxq-server", "mlxq-sharded"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_command_runs(name):
    module, _, attr = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    # The installed script where pip put it; `python -m` otherwise.
    exe = shutil.which(name)
    cmd = [exe] if exe else [sys.executable, "-m", module]
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
