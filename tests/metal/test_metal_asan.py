"""An AddressSanitizer build of the emulated kernels.

The emulator runtime and every metal/*.metal file (f32 instances) are
compiled with -fsanitize=address and run in a child Python with libasan
preloaded, on exact-size buffers: a device read or write out of bounds
aborts the child with ASan's report. A planted out-of-bounds write
(MQ_BUG_OOB_WRITE in mlxq_copy4d) proves the build catches one.
"""

import os
import subprocess
import sys

import pytest
from emu import METAL_DIR, asan_preload, build

PRELOAD = asan_preload()
pytestmark = pytest.mark.skipif(
    PRELOAD is None, reason="the C++ compiler has no AddressSanitizer runtime"
)


def run_child(build_dir, what):
    env = dict(
        os.environ,
        LD_PRELOAD=PRELOAD,
        MSL_EMU_STACK_KB="256",
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=23",
    )
    return subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "asan_driver.py"),
            build_dir,
            what,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.slow
def test_kernels_under_address_sanitizer():
    r = run_child(build(defines=["MQ_ONLY_F32"], sanitize=True, name="asan"), "kernels")
    assert r.returncode == 0 and "ASAN-DRIVER-OK" in r.stdout, r.stderr[-4000:]
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]


@pytest.mark.slow
def test_address_sanitizer_catches_an_out_of_bounds_write():
    src = os.path.join(METAL_DIR, "ring_update.metal")
    r = run_child(build([src], defines=["MQ_BUG_OOB_WRITE"], sanitize=True, name="asan-bug"), "oob")
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, (
        r.returncode,
        r.stderr[-4000:],
    )
