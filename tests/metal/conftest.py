"""Fixtures of the Metal emulator tests.

The emulator lives in tools/msl_emu. Builds (cached by content hash under
build/msl_emu, or $MLXQ_EMU_CACHE) are made once per test run. Every test that
takes ``emu`` runs under the emulator's three thread schedules: default
(threads in order), reverse, and random (seeded per test), and on a build with
floating-point contraction into FMA ("fma").
"""

import os
import sys
import zlib

import mlx.core as mx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "msl_emu"))

from emu import Emulator, build  # noqa: E402

SCHEDULES = ["default", "reverse", "random"]

# The emulator's runtime is built with g++/clang for Linux (x86-64 context
# switch, ucontext elsewhere, ELF rpaths). On a Mac, the Metal backend runs
# the real kernels and the tests in tests/ exercise it on the GPU device.
if not sys.platform.startswith("linux"):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def device():
    """The emulator tests run once, whatever GPU MLX has: the references and
    inputs are computed on the CPU (overrides tests/conftest.py's fixture)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield mx.cpu
    mx.set_default_device(previous)


@pytest.fixture(scope="session")
def metal_build():
    """The project's metal/*.metal, compiled for the emulator."""
    return build()


@pytest.fixture(scope="session")
def metal_emu(metal_build):
    e = Emulator(metal_build)
    e.set_option("strict", 1)
    e.set_option("poison", 1)
    return e


@pytest.fixture(params=SCHEDULES)
def schedule(request):
    return request.param


def _apply(e, schedule, request):
    e.set_schedule(schedule, seed=zlib.crc32(request.node.nodeid.encode()))
    return e


@pytest.fixture(scope="session")
def metal_emu_fma(metal_build):
    """The same kernels built with floating-point contraction into FMA (as
    Apple's compiler may contract a*b + c): results must stay inside the same
    tolerances, and the quantizer bit-identical."""
    e = Emulator(build(contract=True))
    e.set_option("strict", 1)
    e.set_option("poison", 1)
    return e


# The kernel tests' variants: the three schedules, and the contracted build
# (default schedule: contraction changes rounding, not thread order).
EMU_VARIANTS = SCHEDULES + ["fma"]


@pytest.fixture(params=EMU_VARIANTS)
def emu(request):
    if request.param == "fma":
        e = request.getfixturevalue("metal_emu_fma")
        yield _apply(e, "default", request)
        return
    e = request.getfixturevalue("metal_emu")
    yield _apply(e, request.param, request)
    e.set_schedule("default")
