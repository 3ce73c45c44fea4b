"""Address-space-strict check of every metal/*.metal file (see strict.py),
and proof that it catches the address-space bugs the emulator cannot."""

import glob
import os

import pytest
from strict import apply_diff, check, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METAL = os.path.join(ROOT, "metal")
PLANTED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted")
SOURCES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(METAL, "*.metal")))
PLANTED = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PLANTED_DIR, "*.diff")))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(METAL, str(tmp_path_factory.mktemp("strict") / "metal"))


def test_every_metal_file_is_checked():
    assert SOURCES == [
        "dequantize.metal",
        "qsdpa_decode.metal",
        "qsdpa_prefill.metal",
        "ring_update.metal",
    ]
    assert len(PLANTED) == 5


@pytest.mark.parametrize("name", SOURCES)
def test_sources_pass_the_strict_check(prepared, name):
    result = check(prepared, os.path.join(prepared, name))
    assert result.ok, "\n".join(result.errors + result.generic_pointers)


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_address_space_bug_fails(tmp_path, bug):
    """Each planted bug (a threadgroup pointer to a device parameter, a
    constant& passed as device&, a threadgroup array as device uint*, a
    threadgroup pointer in an unqualified local, a device pointer to an
    unqualified parameter) compiles in the emulator but not in xcrun metal:
    the check must fail on some file that includes the changed one."""
    d = prepare(METAL, str(tmp_path / "metal"))
    changed = os.path.basename(apply_diff(d, os.path.join(PLANTED_DIR, bug)))
    results = [check(d, os.path.join(d, name)) for name in SOURCES]
    assert not all(r.ok for r in results), f"{bug} ({changed}) passed the strict check"
