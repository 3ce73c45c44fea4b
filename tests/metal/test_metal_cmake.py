"""cmake/metal.cmake marks mlxq.metallib for an explicit macOS version
(and turns Metal warnings into errors on request).

Configured here with stand-ins for MLX's mlx_build_metallib and for the
target commands (no Metal toolchain needed): what deployment target the real
helper would receive, by default and when overridden.
"""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """cmake_minimum_required(VERSION 3.24)
project(metal_cmake_probe LANGUAGES NONE)
macro(mlx_build_metallib)
  cmake_parse_arguments(M "" "TARGET;TITLE;OUTPUT_DIRECTORY;DEPLOYMENT_TARGET"
                        "SOURCES;INCLUDE_DIRS;DEPS;COMPILE_OPTIONS" ${ARGN})
  message(STATUS "mlxq-probe DEPLOYMENT_TARGET=${M_DEPLOYMENT_TARGET}")
  message(STATUS "mlxq-probe COMPILE_OPTIONS=${M_COMPILE_OPTIONS};")
endmacro()
foreach(cmd target_sources target_include_directories add_dependencies install)
  cmake_language(EVAL CODE "function(${cmd})\\nendfunction()")
endforeach()
set(CMAKE_CURRENT_SOURCE_DIR "%s")
include("%s/cmake/metal.cmake")
"""


def cmake():
    exe = shutil.which("cmake")
    if exe is None:  # the test extra installs the cmake wheel
        from cmake import CMAKE_BIN_DIR

        exe = os.path.join(CMAKE_BIN_DIR, "cmake")
    return exe


def configure(tmp_path, *defines):
    src = tmp_path / "probe"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(PROBE % (ROOT, ROOT))
    out = subprocess.run(
        [cmake(), "-S", str(src), "-B", str(tmp_path / "build"), *defines],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    target = re.search(r"mlxq-probe DEPLOYMENT_TARGET=(\S*)", out).group(1)
    options = re.search(r"mlxq-probe COMPILE_OPTIONS=(\S*)", out).group(1)
    return target, [o for o in options.split(";") if o]


@pytest.mark.parametrize(
    "defines,expected",
    [
        ((), "14.0"),  # what MLX 0.32 requires (MSL 3.1)
        (("-DCMAKE_OSX_DEPLOYMENT_TARGET=15.0",), "15.0"),
        (("-DMLXQ_METAL_DEPLOYMENT_TARGET=14.4",), "14.4"),
    ],
)
def test_metallib_deployment_target(tmp_path, defines, expected):
    target, options = configure(tmp_path, *defines)
    assert target == expected and options == []


def test_werror_for_the_macos_ci_job(tmp_path):
    assert configure(tmp_path, "-DMLXQ_METAL_WERROR=ON") == ("14.0", ["-Werror"])
