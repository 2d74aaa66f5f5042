"""The house rules of the package layout, checked on the source: imports point downward only,
Prefect stays in the pipeline, test hooks stay out of the product, modules stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"

# Floors, lowest first. A module may import its own package and anything on a lower floor.
FLOORS: dict[str, int] = {
    "posttrain": 0, "posttrain.fsutil": 0, "posttrain.errors": 0, "posttrain.redact": 0, "posttrain.rewards": 0,
    "posttrain.testing.crashpoints": 0,
    "posttrain.storage": 1, "posttrain.cluster": 1,
    "posttrain.chain": 2, "posttrain.datasets": 2, "posttrain.rollouts": 2, "posttrain.lora": 2,
    "posttrain.trainer": 3, "posttrain.models": 3, "posttrain.publish": 3, "posttrain.inference": 3,
    "posttrain.promote": 3, "posttrain.promote.promoter": 4,
    # gc keeps what the promotion histories need: it reads them, so it sits above promote.
    "posttrain.publish.gc": 4,
    "posttrain.runs": 4,
    "posttrain.serve": 5,
    "posttrain.testing": 6,
    "posttrain.pipeline": 7,
    "posttrain.cli": 8,
    "posttrain.__main__": 9,
}
# The only modules outside the pipeline that may import prefect: CLI commands that start flows.
PREFECT_OUTSIDE_PIPELINE = {"posttrain.cli.demo", "posttrain.cli.prefect_setup"}
MAX_LINES = 400


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append((name, path))
    return found


def unit(module: str) -> str:
    """The FLOORS entry a module belongs to: its longest listed prefix."""
    best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len)
    return best


def imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
    return found


@pytest.mark.parametrize("name,path", modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_point_downward(name: str, path: Path) -> None:
    own = unit(name)
    problems = []
    for target, line in imports(path):
        if target != "posttrain" and not target.startswith("posttrain."):
            continue
        other = unit(target)
        if other == own or target == "posttrain":
            continue
        if FLOORS[other] >= FLOORS[own]:
            problems.append(f"{path.name}:{line} imports {target} (floor {FLOORS[other]}) from floor {FLOORS[own]}")
    assert not problems, "\n".join(problems)


def test_only_the_pipeline_imports_prefect() -> None:
    offenders = [
        f"{name}:{line}"
        for name, path in modules()
        if not name.startswith("posttrain.pipeline") and name not in PREFECT_OUTSIDE_PIPELINE
        for target, line in imports(path)
        if target == "prefect" or target.startswith("prefect.")
    ]
    assert not offenders


def test_product_code_has_no_test_hooks() -> None:
    """Only the publisher's documented crash points reach into posttrain.testing."""
    offenders = [
        f"{name}:{line} imports {target}"
        for name, path in modules()
        if not name.startswith("posttrain.testing")
        for target, line in imports(path)
        if target.startswith("posttrain.testing") and target != "posttrain.testing.crashpoints"
    ]
    assert not offenders
    assert not [p for _, p in modules() if "POSTTRAIN_INJECT_FAULT" in p.read_text(encoding="utf-8")]


def test_modules_are_short() -> None:
    """Over MAX_LINES only for modules of pure declarations (config models)."""
    long = [f"{p.relative_to(PACKAGE.parent)} ({n})" for _, p in modules()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES and p.name != "config.py"]
    assert not long
