"""The product cites only documents a clone of the repository has: no path outside it
(``shared/spec``, ``../shared``), and every ``docs/<name>.md`` it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a user who clones the repository reads: the package, the README, scripts and benchmarks.
PRODUCT = [ROOT / "posttrain", ROOT / "README.md", ROOT / "scripts", ROOT / "bench"]
OUTSIDE = ("shared/spec", "../shared")
DOC_CITATION = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".yaml", ".yml", ".toml", ".json", ".cfg", ".ini", ""}


def product_files() -> list[Path]:
    files = []
    for root in PRODUCT:
        if root.is_file():
            files.append(root)
        elif root.is_dir():
            files += [p for p in sorted(root.rglob("*"))
                      if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    return files


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def test_the_product_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in product_files()}
    assert "README.md" in names
    assert "posttrain/serve/server.py" in names


@pytest.mark.parametrize("outside", OUTSIDE)
def test_no_file_cites_a_path_outside_the_repository(outside: str):
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in product_files()
             for n, line in enumerate(read(p).splitlines(), 1) if outside in line]
    assert not found, f"{outside} is not in a clone of the repository; cite docs/ instead:\n" + "\n".join(found)


def cited_docs() -> dict[str, list[str]]:
    """docs/<name>.md -> where it is cited, in the package's Python files and the README."""
    sources = sorted((ROOT / "posttrain").rglob("*.py")) + [ROOT / "README.md"]
    cited: dict[str, list[str]] = {}
    for p in sources:
        for n, line in enumerate(read(p).splitlines(), 1):
            for name in DOC_CITATION.findall(line):
                cited.setdefault(name, []).append(f"{p.relative_to(ROOT)}:{n}")
    return cited


def test_the_docs_the_code_cites_are_cited():
    # the citations this test guards; a regex that found none would make the next test vacuous
    assert {"hotload-api.md", "delta-format.md", "cluster-backends.md"} <= set(cited_docs())


def test_every_cited_doc_exists():
    missing = {f"docs/{name}": where for name, where in cited_docs().items() if not (ROOT / "docs" / name).is_file()}
    assert not missing, f"cited but not in docs/: {missing}"
