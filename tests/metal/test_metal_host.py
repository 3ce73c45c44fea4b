"""The Metal host code (csrc/metal/*.cpp) compiles against the installed
MLX's real Metal headers (device.h: CommandEncoder, Device, get_library /
get_kernel, ...), with a declarations-only stand-in for Apple's metal-cpp
(host_check/Metal/Metal.hpp). A syntax check only: it catches calls that do
not match MLX's API; it cannot link or run anything (no Metal on Linux)."""

import glob
import os
import subprocess

import pytest
from emu import CXX, HERE, ROOT
from mlx_oracle import mlx_include_dir

SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "metal", "*.cpp")))


@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_host_code_compiles_against_mlx_metal_headers(source):
    inc = mlx_include_dir()
    assert os.path.exists(os.path.join(inc, "mlx", "backend", "metal", "device.h"))
    cmd = [
        CXX,
        "-std=c++20",
        "-fsyntax-only",
        "-D_METAL_",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-isystem",
        os.path.join(HERE, "host_check"),
        "-isystem",
        inc,
        "-I",
        os.path.join(ROOT, "csrc"),
        "-I",
        os.path.join(ROOT, "metal"),  # as CMakeLists.txt puts it on the path
        source,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
