"""Generate the docs pages that are copies of something else, so they cannot drift from it:

- docs/index.md, the docs site's home page: README.md with its links made relative to docs/;
- docs/parameters/*.md, a reference page of every flow's parameters, from the flows' settings models
  (posttrain/pipeline/settings.py, promotion_settings.py): name, type and bounds (the JSON schema an
  enforced deployment checks), default, and description, one table per group of parameters.

Edit README.md or the settings models, never these pages; then run this and commit what it writes.
tests/test_docs_pages.py fails when a committed page differs from what this writes.

    .venv/bin/python scripts/docs_pages.py            # writes docs/index.md and docs/parameters/
    .venv/bin/python scripts/docs_pages.py --check    # exit 1, naming the stale pages, when one differs
"""

from __future__ import annotations

import argparse
import html
import inspect
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python scripts/docs_pages.py"


# ---- the front page ------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_LINK = re.compile(r"\]\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")
REFERENCE_LINK = re.compile(r"^(\s*\[[^\]]+\]:\s*)(\S+)(.*)$")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#)", re.IGNORECASE)  # https:, mailto:, an anchor of the page


class LinkError(ValueError):
    """A README link the docs site cannot follow."""


def site_target(target: str, line_no: int) -> str:
    """A README link's target as docs/index.md's: ``docs/x.md#a`` is ``x.md#a``; a URL or anchor stays."""
    if EXTERNAL.match(target):
        return target
    if target.startswith("docs/"):
        return target.removeprefix("docs/")
    raise LinkError(f"README.md:{line_no}: links {target}, which is not under docs/ (the docs site has only "
                    f"docs/): link a docs page or a URL, or name the file as code")


def front_page(readme: str) -> str:
    """docs/index.md: the README, its links to docs/ pages made relative to docs/ (code blocks as they are)."""
    out, fenced = [], False
    for n, line in enumerate(readme.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = INLINE_LINK.sub(lambda m: f"]({site_target(m.group(1), n)}{m.group(2)})", line)
            if m := REFERENCE_LINK.match(line):
                line = f"{m.group(1)}{site_target(m.group(2), n)}{m.group(3)}"
        out.append(line)
    header = (f"<!-- Generated from README.md by scripts/docs_pages.py: edit README.md, then run {COMMAND} -->")
    return "\n".join([header, *out]) + "\n"


# ---- the parameters pages ------------------------------------------------------------------------

class FlowPage(NamedTuple):
    slug: str  # docs/parameters/<slug>.md
    entrypoint: str  # as prefect.yaml names it
    model: type[BaseModel]
    source: str  # the settings model's module, as a path


def flow_pages() -> list[FlowPage]:
    from posttrain.pipeline.promotion_settings import PromoteSettings, RollbackSettings
    from posttrain.pipeline.settings import GrpoSettings, NightlySettings

    settings, promotion = "posttrain/pipeline/settings.py", "posttrain/pipeline/promotion_settings.py"
    return [FlowPage("nightly", "posttrain/pipeline/flows/nightly.py:nightly_post_training", NightlySettings, settings),
            FlowPage("grpo", "posttrain/pipeline/flows/grpo.py:grpo", GrpoSettings, settings),
            FlowPage("promote", "posttrain/pipeline/flows/promote.py:promote", PromoteSettings, promotion),
            FlowPage("rollback", "posttrain/pipeline/flows/promote.py:rollback", RollbackSettings, promotion)]


def load_flow(entrypoint: str):
    import importlib

    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def deployments(entrypoint: str) -> list[dict]:
    """prefect.yaml's deployments of the flow at ``entrypoint``."""
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text(encoding="utf-8"))
    return [d for d in config.get("deployments") or [] if d.get("entrypoint") == entrypoint]


def pattern_words() -> dict[str, str]:
    """Patterns of the schemas said in words (the others are shown as they are)."""
    from posttrain.pipeline.refs import ABSOLUTE, BLOCK_REF
    from posttrain.rollouts.scoring import REWARD_FUNC_PATTERN

    words = {ABSOLUTE["pattern"]: "an absolute path", BLOCK_REF: "a block, `block-type-slug/block-name`",
             REWARD_FUNC_PATTERN: "an import path, `module:function`"}
    return {unguarded(p): text for p, text in words.items()}


def unguarded(pattern: str) -> str:
    """A schema's pattern less the deployments' guard against a final newline (refs.whole_value)."""
    return pattern.removesuffix(r"(?!\n)")


NUMBER_BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))


def number(value) -> str:
    return json.dumps(value)


def kind(schema: dict, defs: dict, words: dict[str, str]) -> str:
    """A property's JSON schema in words: its type, choices and bounds."""
    if "$ref" in schema:
        return kind({**defs[schema["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in schema.items() if k != "$ref"}},
                    defs, words)
    if "enum" in schema:
        text = "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    elif "anyOf" in schema:
        members = [kind(m, defs, words) for m in schema["anyOf"] if m.get("type") != "null"]
        text = " or ".join(members) + (" or null" if any(m.get("type") == "null" for m in schema["anyOf"]) else "")
    else:
        text = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
                "array": "list", "object": "mapping"}.get(schema.get("type", ""), "any value")
        if schema.get("type") == "array" and "items" in schema:
            text += f" of {kind(schema['items'], defs, words)}"
    bounds = [f"{sign} {number(schema[key])}" for key, sign in NUMBER_BOUNDS if key in schema]
    if "minItems" in schema:
        bounds.append(f"at least {schema['minItems']} item{'s' * (schema['minItems'] != 1)}")
    if "maxItems" in schema:
        bounds.append(f"at most {schema['maxItems']} items")
    if "pattern" in schema:
        pattern = unguarded(schema["pattern"])
        bounds.append(words.get(pattern, f"matching `{pattern}`"))
    if "items" in schema and "anyOf" in schema:  # constraints of a list's items beside a "list or null"
        bounds.append(f"each item {kind(schema['items'], defs, words)}")
    return ", ".join([text, *(b for b in bounds if b not in text)])  # an anyOf member may have said it


DOC_MENTION = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)(#[A-Za-z0-9_-]+)?")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose(text: str | None) -> str:
    """A description or docstring as one line of markdown: its ``code`` as `code`, a docs/x.md mention linked."""
    text = " ".join((text or "").split()).replace("``", "`")
    parts = CODE_SPAN.split(text)
    out = []
    for i in range(0, len(parts), 3):  # text, then (ticks, code) pairs
        out.append(DOC_MENTION.sub(lambda m: f"[docs/{m.group(1)}{m.group(2) or ''}](../{m.group(1)}"
                                             f"{m.group(2) or ''})", parts[i]))
        if i + 2 < len(parts):
            out.append(f"{parts[i + 1]}{parts[i + 2]}{parts[i + 1]}")
    return "".join(out)


def cell(text: str) -> str:
    """Markdown for a table cell: a "|" never splits it (a code span holding one becomes <code>)."""
    parts = CODE_SPAN.split(text)
    out = []
    for i in range(0, len(parts), 3):
        out.append(parts[i].replace("|", r"\|"))
        if i + 2 < len(parts):
            code = parts[i + 2]
            out.append(f"<code>{html.escape(code).replace('|', '&#124;')}</code>" if "|" in code
                       else f"{parts[i + 1]}{code}{parts[i + 1]}")
    return "".join(out)


def default(field) -> str:
    if field.is_required():
        return "**required**"
    value = to_jsonable_python(field.get_default(call_default_factory=True))
    return f"`{value}`" if isinstance(value, str) and value else f"`{json.dumps(value)}`"


def table(model: type[BaseModel], names: list[str], words: dict[str, str]) -> list[str]:
    schema = model.model_json_schema()
    defs, props = schema.get("$defs", {}), schema["properties"]
    rows = ["| parameter | type | default | description |", "|---|---|---|---|"]
    for name in names:
        field = model.model_fields[name]
        rows.append(f"| `{name}` | {cell(kind(props[name], defs, words))} | {default(field)} | "
                    f"{cell(prose(field.description))} |")
    return rows


def flow_page(page: FlowPage, groups: tuple[str, ...], words: dict[str, str]) -> str:
    from posttrain.pipeline.parameters import parameter_fields
    from posttrain.pipeline.settings import BLOCK_PARAMETERS, PROMOTION_BLOCK_PARAMETERS

    model, flow = page.model, load_flow(page.entrypoint)
    flat = parameter_fields(model)
    signature = list(inspect.signature(flow.fn).parameters)
    if signature != list(flat):  # the page must be what the flow takes
        raise SystemExit(f"{page.entrypoint}: its parameters are not {model.__name__}'s flat fields: {signature}")
    own = [n for n in model.model_fields if n not in groups]
    grouped = [n for n in model.model_fields if n in groups]
    required = [f"`{n}`" for n, f in flat.items() if f.is_required()]
    deployed = deployments(page.entrypoint)
    blocks = {**BLOCK_PARAMETERS, **PROMOTION_BLOCK_PARAMETERS}
    example = next((n for n in own if not model.model_fields[n].is_required() and n not in blocks), own[0])
    lines = [
        f"<!-- Generated from {model.__name__} ({page.source}) by scripts/docs_pages.py: edit the model, then run "
        f"{COMMAND} -->",
        f"# The {flow.name} flow's parameters",
        "",
        prose(model.__doc__.split("\n\n")[0]) if model.__doc__ else "",
        "",
        f"Its {len(flat)} parameters, all top level (`--param {example}=...`, one field each on the UI's run form), "
        f"are the fields of `{model.__name__}` ({page.source})"
        + (" and of its groups " + ", ".join(f"[`{g}`](#{g})" for g in grouped) if grouped else "") + ". "
        + (f"Required: {', '.join(required)}." if required else "None is required."),
        "",
    ]
    if deployed:
        lines += ["Its deployments in `prefect.yaml` (whose values replace the defaults below): "
                  + "; ".join(f"`{flow.name}/{d['name']}` sets " + ", ".join(f"`{k}`" for k in d.get("parameters") or {})
                              for d in deployed) + ".", ""]
    lines += ["## The run's own parameters", "", *table(model, own, words), ""]
    for group in grouped:
        field, inner = model.model_fields[group], model.model_fields[group].annotation
        own_doc = inner.__doc__ if "__doc__" in vars(inner) else None  # not a base class's
        lines += [f"## `{group}`", "", prose(own_doc or field.description), "",
                  *table(inner, list(inner.model_fields), words), ""]
    return "\n".join(lines)


def parameters_index(pages: list[FlowPage]) -> str:
    from posttrain.pipeline.parameters import parameter_fields

    rows = ["| flow | deployments in `prefect.yaml` | settings model | parameters |", "|---|---|---|---|"]
    for page in pages:
        flow = load_flow(page.entrypoint)
        names = ", ".join(f"`{flow.name}/{d['name']}`" for d in deployments(page.entrypoint)) or "none"
        rows.append(f"| [{flow.name}]({page.slug}.md) | {names} | `{page.model.__name__}` ({page.source}) | "
                    f"{len(parameter_fields(page.model))} |")
    return "\n".join([
        f"<!-- Generated by scripts/docs_pages.py from the flows' settings models: edit them, then run {COMMAND} -->",
        "# Flow parameters",
        "",
        "Every parameter of every flow, with its type and bounds (what a deployment with an enforced parameter "
        "schema checks when a run is created), its default and what it means. The pages are generated from the "
        "flows' settings models, so they say what the code takes. How parameters are given and when each is "
        "checked: [Running it with Prefect](../prefect.md#parameters); the run form: [run-form.md](../run-form.md).",
        "",
        *rows,
        "",
        "A settings model's groups (`trainer`, `rollout`, `publish`, ...) are not parameters themselves: their "
        "fields are, at the top level beside the run's own, so `--param learning_rate=5e-5` changes exactly that "
        "and the deployment's values hold for the rest. The block parameters (`cluster`, `store`, `inference`, "
        "`promote_to`, `production`, `staging`) name a saved block; the blocks' fields are in "
        "[Setting up a site](../site-setup.md#blocks-posttrain-blocks-save-from-file) and "
        "[Where training runs](../cluster-backends.md).",
        "",
    ])


def parameter_pages() -> dict[str, str]:
    from posttrain.pipeline.parameters import GROUPS

    pages, words = flow_pages(), pattern_words()
    out = {"docs/parameters/index.md": parameters_index(pages)}
    for page in pages:
        out[f"docs/parameters/{page.slug}.md"] = flow_page(page, GROUPS, words)
    return out


# ---- writing and checking ------------------------------------------------------------------------

def pages() -> dict[str, str]:
    """Every generated page, by its path under ROOT, as this script writes it."""
    return {"docs/index.md": front_page((ROOT / "README.md").read_text(encoding="utf-8")), **parameter_pages()}


def stale() -> list[str]:
    """The generated pages whose text under ROOT is not what this script writes."""
    root = ROOT
    return [path for path, text in pages().items()
            if not (root / path).is_file() or (root / path).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs")
    args = parser.parse_args(argv)
    try:
        differ = stale()
        if args.check:
            if differ:
                print(f"not what the generator writes: {', '.join(differ)}; run {COMMAND}", file=sys.stderr)
            return 1 if differ else 0
        for path, text in pages().items():
            (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
            (ROOT / path).write_text(text, encoding="utf-8")
        print(f"wrote {', '.join(differ) or 'nothing (every page was up to date)'}")
        return 0
    except LinkError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
