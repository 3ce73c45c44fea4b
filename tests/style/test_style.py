"""The tree's style, as configured in pyproject.toml (ruff: format and lint)
and .clang-format (MLX's C++ style at 100 columns).

Both tools come with the test extra (``pip install -e ".[test]"``); a missing
tool fails here rather than skipping, so CI always checks. clang-format covers
csrc/ (host code and CUDA kernels); the Metal kernel sources in metal/ are left
as written: the emulator and the strict check read them as they are.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CXX_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}


@pytest.fixture(autouse=True)
def device():
    """Style does not depend on the device: run once, not once per device."""
    yield None


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' brings it")
    return found


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_python_is_ruff_formatted():
    out = run(tool("ruff"), "format", "--check", "--diff", ".")
    assert out.returncode == 0, f"run `ruff format .`:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"


def test_python_passes_ruff_lint():
    out = run(tool("ruff"), "check", "--output-format", "concise", ".")
    assert out.returncode == 0, f"ruff check:\n{out.stdout[-3000:]}{out.stderr[-1000:]}"


def test_cxx_is_clang_formatted():
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in CXX_SUFFIXES
    )
    assert files, "no C++ sources found under csrc/"
    out = run(tool("clang-format"), "--dry-run", "--Werror", *files)
    assert out.returncode == 0, f"run clang-format -i on:\n{out.stderr[-3000:]}"


def _layout_entries():
    """The paths docs/development.md's layout block lists ({a,b} braces expanded)."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("Layout (", 1)[1].split("```", 2)[1]
    entries = set()
    for line in block.splitlines():
        if not line or line.startswith(" "):
            continue
        path = line.split()[0]
        if "{" in path:
            head, rest = path.split("{", 1)
            options, tail = rest.split("}", 1)
            entries.update(head + o + tail for o in options.split(","))
        else:
            entries.add(path)
    return entries


def test_layout_matches_the_tree():
    """Every listed path exists, and every source directory and top-level
    csrc/ file is listed (so the section cannot drift from the tree)."""
    entries = _layout_entries()
    missing = sorted(e for e in entries if not (ROOT / e.rstrip("/")).exists())
    assert not missing, f"docs/development.md's layout lists paths that do not exist: {missing}"
    dirs = [d for top in ("csrc", "python/mlxq") for d in (ROOT / top).iterdir() if d.is_dir()]
    wanted = {str(d.relative_to(ROOT)) + "/" for d in dirs if d.name != "__pycache__"}
    wanted |= {
        str(p.relative_to(ROOT))
        for p in (ROOT / "csrc").iterdir()
        if p.is_file() and p.suffix in CXX_SUFFIXES
    }
    unlisted = sorted(w for w in wanted if w not in entries)
    assert not unlisted, f"docs/development.md's layout does not list: {unlisted}"
