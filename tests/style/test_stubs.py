"""python/mlxq/_ext.pyi is nanobind's stubgen output for the built module.

Regenerate it after changing the bindings:

    python -m nanobind.stubgen -P -m mlxq._ext -o python/mlxq/_ext.pyi
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUB = ROOT / "python" / "mlxq" / "_ext.pyi"


@pytest.fixture(autouse=True)
def device():
    yield None


def test_ext_stub_matches_the_built_module(tmp_path):
    out = tmp_path / "_ext.pyi"
    run = subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-P", "-m", "mlxq._ext", "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.read_text() == STUB.read_text(), (
        "python/mlxq/_ext.pyi is stale: python -m nanobind.stubgen -P -m mlxq._ext "
        "-o python/mlxq/_ext.pyi"
    )
