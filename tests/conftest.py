"""Fixtures shared by every mlxq test, and the markers of each test area.

Markers (registered in pyproject.toml): ``lm`` for tests/lm, ``realmodels``
for tests/models, ``emulator`` for tests/metal, ``gpu`` for every case run on
MLX's GPU device; ``slow`` is set per test. ``pytest -m "not slow"`` is the
dev loop.
"""

import pathlib
import zlib

import mlx.core as mx
import numpy as np
import pytest

import mlxq

# Every test runs on each available device: the CPU, and the GPU stream when
# MLX has one (CUDA or Metal). Tests use the default device, so the same test
# body checks every backend's kernels.
DEVICES = [mx.cpu] + ([mx.gpu] if mx.is_available(mx.gpu) else [])


@pytest.fixture(autouse=True, params=DEVICES, ids=lambda d: "gpu" if d == mx.gpu else "cpu")
def device(request):
    previous = mx.default_device()
    mx.set_default_device(request.param)
    yield request.param
    mx.set_default_device(previous)


AREA_MARKERS = {"lm": "lm", "models": "realmodels", "metal": "emulator"}
HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            area = item.path.relative_to(HERE).parts[0]
            if area in AREA_MARKERS:
                item.add_marker(AREA_MARKERS[area])
        callspec = getattr(item, "callspec", None)
        if (
            callspec is not None
            and "device" in callspec.params
            and callspec.params["device"] == mx.gpu
        ):
            item.add_marker("gpu")


def _seed(request) -> int:
    # One stable seed per test and parameter set: fresh inputs for every case,
    # yet a failure reproduces exactly when the test is re-run on its own.
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture(autouse=True)
def poison_outputs(request):
    """Fill every new mlxq output with NaN before its kernel runs.

    An element the kernel forgets to write then stays NaN and fails the
    finiteness checks, instead of passing with whatever memory held before.
    """
    mx.random.seed(_seed(request))
    mlxq._ext._set_poison_outputs(True)
    yield
    mlxq._ext._set_poison_outputs(False)


@pytest.fixture
def set_env():
    """``set_env(name, value)`` sets one MLXQ_* variable for this test, as
    mlxq's environment reader would have parsed it at start."""
    saved = mlxq._ext._environment()
    yield mlxq._ext._set_environment
    for name, value in saved.items():
        mlxq._ext._set_environment(name, value)


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(_seed(request))
