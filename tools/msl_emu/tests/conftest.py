"""Fixtures of the emulator's self-tests.

The sample kernels in ``kernels/`` (and deliberately buggy ones) are built
once per test run; every test that takes ``samples`` runs under the three
thread schedules: default (threads in order), reverse, and random (seeded per
test).
"""

import glob
import os
import sys
import zlib

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from emu import Emulator, build  # noqa: E402

# The runtime is built for Linux (x86-64 context switch, ucontext elsewhere,
# ELF rpaths).
if not sys.platform.startswith("linux"):
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in str(item.path):
            item.add_marker(pytest.mark.emulator)


@pytest.fixture(scope="session")
def samples_emu():
    kdir = os.path.join(HERE, "kernels")
    d = build(sorted(glob.glob(os.path.join(kdir, "*.metal"))), include_dirs=[kdir], name="samples")
    e = Emulator(d)
    e.set_option("strict", 1)
    return e


@pytest.fixture(params=["default", "reverse", "random"])
def samples(samples_emu, request):
    samples_emu.set_schedule(request.param, seed=zlib.crc32(request.node.nodeid.encode()))
    yield samples_emu
    samples_emu.set_schedule("default")
