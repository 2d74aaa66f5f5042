"""The docs pages scripts/docs_pages.py generates: docs/index.md is the README (its links made relative
to docs/), and docs/parameters/ holds every flow's parameters as its settings model has them. A committed
page that differs from what the script writes fails here, naming the command that rewrites it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python scripts/docs_pages.py"


def load_generator():
    return load_script("docs_pages")


@pytest.fixture(scope="module")
def generator():
    return load_generator()


@pytest.fixture(scope="module")
def generated(generator) -> dict[str, str]:
    return generator.pages()


def test_docs_index_is_the_readme(generated: dict[str, str]) -> None:
    committed = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert committed == generated["docs/index.md"], (
        f"docs/index.md is not README.md as the docs site shows it: edit README.md, not docs/index.md, then run "
        f"{COMMAND} and commit docs/index.md")


def test_the_parameters_pages_are_what_the_settings_models_make(generated: dict[str, str]) -> None:
    pages = {path: text for path, text in generated.items() if path.startswith("docs/parameters/")}
    assert {Path(p).name for p in pages} == {"index.md", "nightly.md", "grpo.md", "promote.md", "rollback.md"}
    stale = [p for p, text in pages.items()
             if not (ROOT / p).is_file() or (ROOT / p).read_text(encoding="utf-8") != text]
    assert not stale, f"not what the settings models make: {', '.join(stale)}; run {COMMAND} and commit them"
    extra = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "parameters").glob("*.md")} - set(pages)
    assert not extra, f"docs/parameters/ pages no flow has (a flow's page renamed?): {sorted(extra)}"


def rows(page: str) -> dict[str, list[str]]:
    """A page's parameter rows by name (a name can be a row of only one table): type, default, description."""
    out: dict[str, list[str]] = {}
    for line in page.splitlines():
        if m := re.match(r"^\| `([a-z_0-9]+)` \| (.*) \|$", line):
            assert m.group(1) not in out, f"{m.group(1)} has two rows"
            out[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return out


def test_every_flat_parameter_of_each_flow_is_on_its_page(generator, generated: dict[str, str]) -> None:
    from posttrain.pipeline.parameters import parameter_fields

    for page in generator.flow_pages():
        table = rows(generated[f"docs/parameters/{page.slug}.md"])
        fields = parameter_fields(page.model)
        assert set(table) == set(fields), page.slug
        for name, field in fields.items():
            assert (table[name][1] == "**required**") == field.is_required(), (page.slug, name)
            assert field.description and table[name][2] == generator.cell(generator.prose(field.description))


def test_the_grpo_page_has_the_runs_own_parameters(generated: dict[str, str]) -> None:
    from posttrain.pipeline.settings import GrpoSettings

    table = rows(generated["docs/parameters/grpo.md"])
    for name in ("rounds", "shards", "prompts_per_round"):
        field = GrpoSettings.model_fields[name]
        assert table[name][:2] == ["integer, ≥ 1", f"`{field.default}`"], table[name]
    assert table["max_staleness"][:2] == ["integer, ≥ 0, ≤ 16", "`0`"]
    assert table["trainer_job"][:2] == ["one of `resident`, `per_round`", "`resident`"]
    assert table["base_model"][:2] == ["string, an absolute path", "**required**"]
    # a pattern with "|" does not split its cell (<code> with &#124;, as GitHub and mkdocs both render)
    assert table["dask_address"][0].startswith("string, matching <code>^(tcp&#124;tls"), table["dask_address"]
    # the groups' fields, one table each, linked from the top of the page
    page = generated["docs/parameters/grpo.md"]
    for group in ("publish", "lora", "rollout", "trainer"):
        assert f"\n## `{group}`\n" in page and f"[`{group}`](#{group})" in page
    assert table["num_generations"][:2] == ["integer, ≥ 2", "`4`"]  # the rollout group's
    assert "`grpo/grpo` sets" in page  # its deployment in prefect.yaml


def test_the_front_page_links_resolve_from_docs(generator) -> None:
    readme = "\n".join([
        "# t", "See [a](docs/prefect.md#parameters), [b](docs/parameters/index.md), [c](https://example.com/x.md),",
        "[d](#the-loop) and [e][ref].", "```bash", "echo '[x](docs/not-a-link.md)'", "```", "",
        "[ref]: docs/trainer.md", ""])
    page = generator.front_page(readme)
    assert page.splitlines()[0].startswith("<!-- Generated from README.md") and COMMAND in page.splitlines()[0]
    assert page.splitlines()[1:] == [
        "# t", "See [a](prefect.md#parameters), [b](parameters/index.md), [c](https://example.com/x.md),",
        "[d](#the-loop) and [e][ref].", "```bash", "echo '[x](docs/not-a-link.md)'", "```", "",
        "[ref]: trainer.md"]


def test_a_readme_link_out_of_docs_is_one_line_naming_it(generator) -> None:
    with pytest.raises(generator.LinkError, match=r"^README\.md:2: links scripts/demo\.sh, which is not under docs/"):
        generator.front_page("# t\nrun [the demo](scripts/demo.sh)\n")


def test_check_names_the_stale_pages_and_the_command(generator, tmp_path: Path, monkeypatch, capsys) -> None:
    for path, text in generator.pages().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    for name in ("README.md", "prefect.yaml"):  # what the pages are made from, besides the code
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main(["--check"]) == 0
    with (tmp_path / "README.md").open("a", encoding="utf-8") as f:
        f.write("\nA line the front page does not have yet.\n")
    (tmp_path / "docs" / "parameters" / "grpo.md").unlink()
    assert generator.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"not what the generator writes: docs/index.md, docs/parameters/grpo.md; run {COMMAND}"
    assert generator.main([]) == 0 and generator.main(["--check"]) == 0  # writing them makes them current
    assert (tmp_path / "docs" / "index.md").read_text(encoding="utf-8").endswith("does not have yet.\n")
