"""Fixtures shared by every mlxq test."""

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
def rng(request) -> np.random.Generator:
    return np.random.default_rng(_seed(request))
