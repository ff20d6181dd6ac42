"""The package's layers (README, "Layout"): imports only go down, and no two modules import each other in a circle."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "stapo"
LAYERS = {"": 0, "tools": 1, "train": 2, "quickstart": 3, "checks": 4}
"""Sub-package -> rank: the method (stapo/*.py), the experiment tools, the verl integration, the quickstart, the
GPU checks."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rank(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else 0


def stapo_imports(path: Path) -> set[str]:
    """Every stapo module the file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "stapo"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stapo":
            modules = {f"{node.module}.{a.name}" for a in node.names}
            found |= {m for m in modules if (ROOT.parent / (m.replace(".", "/") + ".py")).is_file()} or {node.module}
    return found


GRAPH = {module_name(p): stapo_imports(p) for p in ROOT.rglob("*.py")}


def test_the_layers_are_the_folders():
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS) - {""}
    assert {m for m in GRAPH if rank(m) == 0} == {"stapo", "stapo.s2t", "stapo.batch_mask", "stapo.config"}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_go_down(module):
    up = sorted(m for m in GRAPH[module] if rank(m) > rank(module))
    assert up == [], f"{module} (layer {rank(module)}) imports a higher layer: {up}"


def test_no_circular_imports():
    def visit(module, path):
        for target in GRAPH.get(module, ()):
            if target in path:
                raise AssertionError(" -> ".join([*path, target]))
            visit(target, [*path, target])

    for module in GRAPH:
        visit(module, [module])
