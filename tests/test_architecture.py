"""The house rules of the package layout, checked on the source: imports point downward only, no
two files import each other (directly or round a longer circle), Prefect stays in the pipeline, test
hooks stay out of the product, modules stay short."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"

# Floors, lowest first. A module may import its own package and anything on a lower floor.
FLOORS: dict[str, int] = {
    "posttrain": 0, "posttrain.fsutil": 0, "posttrain.errors": 0, "posttrain.redact": 0, "posttrain.rewards": 0,
    "posttrain.testing.crashpoints": 0,
    "posttrain.storage": 1, "posttrain.cluster": 1, "posttrain.tasks": 1,
    "posttrain.chain": 2, "posttrain.datasets": 2, "posttrain.rollouts": 2, "posttrain.lora": 2,
    "posttrain.trainer": 3, "posttrain.models": 3, "posttrain.publish": 3, "posttrain.inference": 3,
    "posttrain.promote": 3, "posttrain.promote.sides": 4,
    # promote and rollback, over the sides a promotion compares (a snapshot on staging, what production serves)
    "posttrain.promote.promoter": 4.5,
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


def module_imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The package's modules (files) ``name`` imports, with the line of the first statement for each.

    Every import statement counts: module level, inside functions, under ``TYPE_CHECKING``; a lazy or
    type-only import still ties the two files together. ``from a.b import c`` is the module ``a.b.c``
    when that is a file of the package, else ``a.b``. Importing ``a.b.c`` makes Python run the
    packages ``a`` and ``a.b`` first, but that is not counted as importing them: a package's
    ``__init__`` that imports its own submodules to re-export their names would otherwise be in a
    circle with each submodule that imports a sibling, although the import system always starts the
    package before the submodule and the submodule reads nothing from it. A submodule that names its
    package in a statement (``from posttrain.trainer import TrainerConfig``, a name the ``__init__``
    re-exports) does read from it, and is counted: with an ``__init__`` importing that submodule back,
    that is a circle that works only in one import order."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            if target in known and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_circles() -> list[str]:
    """Every circle of imports between the package's files, each as its files in import order
    (``a.py:3 -> b.py:7 -> a.py``: a.py imports b.py at line 3, b.py imports a.py back at line 7)."""
    paths = dict(modules())
    graph = {name: module_imports(name, path, set(paths)) for name, path in paths.items()}
    circles = []
    while True:
        try:  # an importing module depends on (comes after) the modules it imports
            TopologicalSorter({name: set(targets) for name, targets in graph.items()}).prepare()
            return circles
        except CycleError as e:
            # graphlib lists each node before the nodes that depend on it: reversed, each imports the next
            cycle = e.args[1][::-1]
        hops = [f"{paths[a].relative_to(PACKAGE.parent)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
        circles.append(" -> ".join(hops + [str(paths[cycle[0]].relative_to(PACKAGE.parent))]))
        del graph[cycle[0]][cycle[1]]  # and look for another circle without this import


def test_no_two_files_import_each_other() -> None:
    """No circle of imports between files, counting lazy and TYPE_CHECKING imports: a module imports
    only what is below it, and what two modules share lives in a third that both import."""
    circles = import_circles()
    assert not circles, "import circles (file:line of the import -> the file it imports):\n" + "\n".join(circles)


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
