"""Child process of test_metal_asan.py: runs mlxq's kernels from an
AddressSanitizer build of the emulator (libasan preloaded) on exact-size
buffers, so any out-of-bounds device access aborts with a report.

usage: python asan_driver.py BUILD_DIR {kernels|oob}
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(ROOT, "tools", "msl_emu")]

import numpy as np  # noqa: E402
from emu import Emulator  # noqa: E402
from harness import run_copy4d, run_quantized_ring_update, run_ring_update  # noqa: E402
from sdpa_cases import Case, run_case  # noqa: E402


def kernels(e):
    rng = np.random.default_rng(0)
    for kw, mask, mode in [
        (dict(Hq=8, Hkv=2, L=1, N=100, Dk=128, bits=4, group_size=64), "causal", "decode"),
        (
            dict(B=2, Hq=4, Hkv=1, L=3, N=77, Dk=96, Dv=160, bits=3, group_size=32),
            "bool_BHLN",
            "decode",
        ),
        (
            dict(Hq=4, Hkv=2, L=20, N=45, Dk=512, Dv=128, bits=8, group_size=128),
            "add_f32",
            "prefill",
        ),
        (dict(Hq=2, Hkv=1, L=17, N=33, Dk=64, bits=5, group_size=64), "causal", "prefill"),
        (
            dict(Hq=6, Hkv=3, L=2, N=300, Dk=256, Dv=512, bits=6, group_size=32),
            "bool_keypad",
            "decode",
        ),
        (dict(Hq=1, Hkv=1, L=1, N=1, Dk=32, bits=2, group_size=32), "none", "auto"),
    ]:
        run_case(e, Case(rng, **kw), rng, mask, True, mode=mode, min_block_keys=32)
    buf = rng.standard_normal((2, 3, 7, 24)).astype(np.float32)
    upd = rng.standard_normal((2, 3, 4, 24)).astype(np.float32)
    expect = buf.copy()
    expect[:, :, [5, 6, 0, 1]] = upd
    run_ring_update(e, buf, upd, 5)
    assert np.array_equal(buf, expect)
    for bits in (2, 3, 4, 5, 6, 8):
        triple = [
            np.zeros((1, 2, 3, 128 * bits // 32), np.uint32),
            np.zeros((1, 2, 3, 4), np.float32),
            np.zeros((1, 2, 3, 4), np.float32),
        ]
        run_quantized_ring_update(
            e,
            triple,
            rng.standard_normal((1, 2, 2, 128)).astype(np.float32),
            2,
            group_size=32,
            bits=bits,
            tag="f32",
        )
    src = rng.standard_normal((2, 3, 5, 9)).astype(np.float32)
    assert np.array_equal(run_copy4d(e, src.transpose(0, 2, 1, 3)), src.transpose(0, 2, 1, 3))


def oob(e):
    run_copy4d(e, np.ones((1, 1, 3, 5), np.float32))


if __name__ == "__main__":
    e = Emulator(sys.argv[1])
    {"kernels": kernels, "oob": oob}[sys.argv[2]](e)
    print("ASAN-DRIVER-OK")
