"""The package's folders follow the data path, and imports only go down it.

A route is fetched (`torch_r3.rollout`), batched (`torch_r3.collate`) and replayed
(`torch_r3.replay`, then the framework hooks). Each layer below may be imported by the
layers above it, never the other way; `rollout` and `collate` are siblings that never
import each other (a trainer that only collates does not load the HTTP client). Every
import counts, including the lazy ones inside functions (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torch_r3"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "torch_r3.errors",
            "torch_r3.keys",
            "torch_r3.cpu",
            "torch_r3._checks",
            "torch_r3._deprecation",
            "torch_r3._extras",
        ),
    ),
    ("health", ("torch_r3.health",)),
    ("payloads", ("torch_r3.routes", "torch_r3.selections")),
    ("rollout", ("torch_r3.rollout",)),
    ("collate", ("torch_r3.collate",)),
    ("replay", ("torch_r3.replay",)),
    ("hooks", ("torch_r3.megatron", "torch_r3.transformers", "torch_r3.indexer")),
    ("cluster", ("torch_r3.ray", "torch_r3.distributed", "torch_r3.integrations")),
    (
        "tools",
        (
            "torch_r3.runlog",
            "torch_r3.report",
            "torch_r3.doctor",
            "torch_r3.bench",
            "torch_r3.demo",
            "torch_r3.testing",
            "torch_r3.cli",
            "torch_r3.__main__",
        ),
    ),
]
SIBLINGS = {frozenset({"rollout", "collate"})}


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def module_name(path: Path) -> tuple[str, list[str]]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts), package


def is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, the names of a `from` import included."""
    name, package = module_name(path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base) + (f".{node.module}" if node.module else "")
            else:
                target = node.module or ""
            if target != "torch_r3":
                found.append((node.lineno, target))
            for alias in node.names:
                qualified = f"{target}.{alias.name}"
                # `from torch_r3 import ray` is the submodule; `from torch_r3 import X` the face.
                found.append(
                    (node.lineno, "torch_r3" if target == "torch_r3" and not is_module(qualified) else qualified)
                )
    return [(line, target) for line, target in found if target == "torch_r3" or target.startswith("torch_r3.")]


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_module_has_a_layer():
    unplaced = [module_name(p)[0] for p in MODULES if layer_of(module_name(p)[0]) is None]
    assert unplaced == []


def test_the_import_graph_is_read_from_real_code():
    # The parser sees relative and lazy imports: the collator imports its pool, the
    # replay hook imports the routes' validators inside functions.
    collator = dict((t, line) for line, t in imports(PACKAGE / "collate" / "collator.py"))
    assert any(t.startswith("torch_r3.collate.") for t in collator)
    assert sum(len(imports(p)) for p in MODULES) > 500


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down_the_data_path(path):
    name, _ = module_name(path)
    own = layer_of(name)
    assert own is not None
    wrong = []
    for line, target in imports(path):
        if target == "torch_r3":
            # The package face re-exports everything: only the tools may lean on it.
            if LAYERS[own][0] != "tools":
                wrong.append(f"line {line}: the torch_r3 face")
            continue
        other = layer_of(target)
        if other is None:
            continue
        pair = frozenset({LAYERS[own][0], LAYERS[other][0]})
        if other > own or (pair in SIBLINGS and len(pair) == 2):
            wrong.append(f"line {line}: {target} ({LAYERS[other][0]}) from the {LAYERS[own][0]} layer")
    assert wrong == [], f"{name}: " + "; ".join(wrong)
