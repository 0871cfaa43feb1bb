"""The package's floors (docs/architecture.md): imports point down only, and no module
imports a module of a higher floor (kernels -> cache/model -> attention -> engine ->
server/integrations/eval/bench/training -> cli; config, errors, io and data below all)."""

import ast
from pathlib import Path

import sparda

ROOT = Path(sparda.__file__).parent
FLOOR = {"errors": 0, "config": 0, "io": 0, "data": 0, "kernels": 1, "cache": 2, "model": 2, "attention": 3,
         "engine": 4, "server": 5, "integrations": 5, "eval": 5, "bench": 5, "training": 5, "hf": 5,
         "lm_eval_model": 5, "cli": 6, "__main__": 6}
#: names the package root re-exports (sparda/__init__.py): the engine's floor
ROOT_NAMES = 4


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "sparda":
            yield from (alias.name if alias.name in FLOOR else None for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("sparda."):
            yield node.module.split(".")[1]
        elif isinstance(node, ast.Import):
            yield from (a.name.split(".")[1] for a in node.names if a.name.startswith("sparda."))


def test_imports_point_down_only():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue  # the root facade re-exports the public API
        mine = FLOOR[rel.parts[0].removesuffix(".py")]
        for target in _imports(path):
            floor = ROOT_NAMES if target is None else FLOOR[target]
            if target != rel.parts[0].removesuffix(".py") and floor > mine:
                upward.append(f"{rel} imports {target or 'sparda (root)'}")
    assert not upward, upward


def test_every_module_has_a_floor():
    assert {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.rglob("*.py")} - {"__init__"} <= set(FLOOR)
