"""The README and docs/ say what is: no history, no dead links, no
unprovenanced results, and a front door short enough to read."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *DOCS]

# Words that tell how the project came to be rather than what it is.
HISTORY = re.compile(
    r"\bsessions?\b|\bleases?\b|\bissue\s*#?\d+|\bearlier runs?\b|\bused to\b", re.I
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.fixture(autouse=True)
def device():
    """Docs do not depend on the device: run once."""
    yield None


def _rel(p):
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_history_words(page):
    hits = [
        f"{_rel(page)}:{n}: {m.group(0)!r}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not hits, "history words (say what is; git log keeps how):\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = [
        target
        for target in LINK.findall(page.read_text())
        if "://" not in target
        and not target.startswith("mailto:")
        and not (page.parent / target).exists()
    ]
    assert not broken, f"{_rel(page)} links to missing files: {broken}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    head = "\n".join(lines[:100])
    for must in ("pip install", "mlxq.mlx_lm.enable()", "| backend"):
        assert must in head, f"README.md's first 100 lines lack {must!r}"


RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))


@pytest.mark.parametrize("page", RESULTS, ids=_rel)
def test_every_results_table_has_provenance(page):
    """Each table on a results page is introduced by its machine, commit and
    the command that remakes it."""
    text = page.read_text()
    sections = re.split(r"^#+ ", text, flags=re.M)[1:]
    tables = [s for s in sections if re.search(r"^\|.*\|$", s, re.M)]
    assert tables, f"{_rel(page)} has no table"
    for s in tables:
        title = s.splitlines()[0]
        for field in ("Machine:", "Commit:", "Command:"):
            assert field in s, f"{_rel(page)}, '{title}': no {field!r} line"


def test_bench_results_are_read():
    """Every file in bench/results/ is read by a doc page or a test."""
    readers = "\n".join(p.read_text() for p in PAGES)
    readers += "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    unread = [
        p.name for p in sorted((ROOT / "bench" / "results").iterdir()) if p.name not in readers
    ]
    assert not unread, f"bench/results/ files no doc page or test reads: {unread}"


def test_every_variable_is_documented():
    """docs/environment.md names every variable mlxq's environment reader parses."""
    import mlxq

    page = (ROOT / "docs" / "environment.md").read_text()
    missing = [name for name in mlxq._ext._environment() if f"`{name}`" not in page]
    assert not missing, f"docs/environment.md does not document {missing}"
