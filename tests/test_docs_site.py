"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a page
missing from the nav or a link out of ``docs/`` fails it. The README stays a front page: it starts
with the two commands and links every page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site), "-f", str(ROOT / "mkdocs.yml")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a warning of ours
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode} (mkdocs is a dev dependency: "
                                  f"bash scripts/setup.sh):\n{proc.stdout}{proc.stderr}")
    assert (site / "index.html").is_file() and (site / "prefect" / "index.html").is_file()


def test_the_readme_starts_with_the_two_commands_and_stays_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: it is the front page, the rest goes in docs/"
    body = [line for line in lines if line.strip()]
    assert body[0] == "# posttrain" and body[1] == "```bash", body[:2]
    assert body[2].startswith("bash scripts/demo.sh") and body[3].startswith("bash scripts/test.sh"), body[2:4]


def linked_pages(text: str, prefix: str) -> set[str]:
    return set(re.findall(r"\]\(" + re.escape(prefix) + r"([A-Za-z0-9_.-]+\.md)(?:#[^)]*)?\)", text))


def test_the_front_page_links_every_page() -> None:
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    readme = linked_pages((ROOT / "README.md").read_text(encoding="utf-8"), "docs/")
    index = linked_pages((DOCS / "index.md").read_text(encoding="utf-8"), "")
    assert pages - readme == set(), "README.md does not link these pages"
    assert pages - index == set(), "docs/index.md does not link these pages"
