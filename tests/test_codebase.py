"""House rules that a reader can check with grep, checked on every module of `torch_r3/`.

The private-name rule: a name that starts with one underscore (and is not a dunder) belongs
to the module that defines it. Another module of the package may import a private *module*
(`from torch_r3 import _extras`, `import torch_r3.collate._memory as memory`) and use its public
names, but it never reaches a private *name* of another module: neither
`from torch_r3.a import _b` nor `a._b` on a module it imported. A private name that is
itself a module (`torch_r3.testing._wire`) counts as a module.
"""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torch_r3"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    """Whether `dotted` (`torch_r3.a._b`) names a module or package of this package."""
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reaches(path: Path) -> list[str]:
    """Every private name of another `torch_r3` module that `path` imports or reads as an attribute."""
    here = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> the torch_r3 module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch_r3" or alias.name.startswith("torch_r3."):
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        modules["torch_r3"] = "torch_r3"
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, here, path.name == "__init__.py")
            if source is None or not (source == "torch_r3" or source.startswith("torch_r3.")):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if _is_module(target):
                    modules[alias.asname or alias.name] = target
                elif _is_private(alias.name) and source != here:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in modules:
            continue
        # Walk `m.a.b` from the outermost module: the first attribute that is not a
        # module is the name read from that module.
        dotted = modules[inner.id]
        for attr in reversed(chain):
            if _is_module(f"{dotted}.{attr}"):
                dotted = f"{dotted}.{attr}"
                continue
            if _is_private(attr) and dotted != here:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {dotted}.{attr}")
            break
    return sorted(set(found))


def test_the_scanner_finds_each_kind_of_reach(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fixture package laid out like ours, so the rule's edges are pinned down.
    root = tmp_path / "torch_r3"
    (root / "sub").mkdir(parents=True)
    for name in ["__init__.py", "_memory.py", "a.py", "sub/__init__.py", "sub/_wire.py"]:
        (root / name).write_text("")
    user = root / "user.py"
    user.write_text(
        "import torch_r3._memory as memory\n"
        "from torch_r3 import _memory, a\n"
        "from torch_r3.a import _hidden, public\n"
        "from torch_r3.sub import _wire\n"
        "from . import a as same\n"
        "memory.pinned_bytes(); memory._pool_size(); _memory.__name__\n"
        "a._secret; same._other; _wire.make; _wire._table\n"
        "import torch_r3\n"
        "torch_r3.sub._wire._deep\n"
        "def _mine(): pass\n"
        "_mine()\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    assert sorted(line.split(": ", 1)[1] for line in private_reaches(user)) == [
        "from torch_r3.a import _hidden",
        "torch_r3._memory._pool_size",
        "torch_r3.a._other",
        "torch_r3.a._secret",
        "torch_r3.sub._wire._deep",
        "torch_r3.sub._wire._table",
    ]


def test_no_private_name_is_reached_across_modules() -> None:
    found = [line for path in _modules() for line in private_reaches(path)]
    assert found == [], "private names used outside their module:\n" + "\n".join(found)


def test_deprecations_fail_the_suite_unless_a_third_party_one_is_filtered_by_name(
    pytestconfig: pytest.Config,
) -> None:
    filters = pytestconfig.getini("filterwarnings")
    assert "error::DeprecationWarning" in filters and "error::FutureWarning" in filters
    for entry in filters:
        action, message, category, module = (entry.split(":") + ["", "", "", ""])[:4]
        if action == "ignore" and category in ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning"):
            assert message or module, f"{entry!r} ignores a whole category; name the module or the message"
    # The filters are in force in every test: one attributed to our code raises, Megatron's does not.
    with pytest.raises(DeprecationWarning, match="ours"):
        warnings.warn_explicit("ours", DeprecationWarning, "codec.py", 1, module="torch_r3.rollout.codec")
    with pytest.raises(FutureWarning, match="ours"):
        warnings.warn_explicit("ours", FutureWarning, "collate.py", 1, module="torch_r3.collate")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("theirs", DeprecationWarning, "layers.py", 1, module="megatron.core.tensor_parallel")
    assert seen == []


FRAMEWORKS = ("megatron", "transformers")
HOOKS = ("torch_r3.megatron", "torch_r3.transformers")


def imports_of(path: Path) -> set[str]:
    """The modules `path` imports, wherever the import statement sits (top level or inside a function).

    A `from a import b` counts as importing `a.b` when that is a module of this
    package, and `a` otherwise; a package's parents are not counted (importing
    `torch_r3.a.b` runs `torch_r3/__init__.py` first, but that is no choice of `path`).
    `importlib.import_module("a.b")` with a literal name is an import of `a.b` too
    (a name built at run time, `f"torch_r3.demo.{trainer}"`, cannot be followed).
    """
    here = _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, here, path.name == "__init__.py")
            if source is None:
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                found.add(target if _is_module(target) else source)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def test_imports_of_follows_a_literal_import_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "torch_r3").mkdir()
    path = tmp_path / "torch_r3" / "m.py"
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "torch_r3")
    path.write_text(
        "import importlib\n"
        "def f(name):\n"
        "    importlib.import_module('torch_r3.demo.dsa')\n"
        "    importlib.import_module(f'torch_r3.demo.{name}')\n"
    )
    assert imports_of(path) == {"importlib", "torch_r3.demo.dsa"}


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_replay_core_imports_no_training_framework_and_no_hook():
    found = []
    for path in sorted((PACKAGE / "replay").rglob("*.py")):
        for module in imports_of(path):
            if any(_is_under(module, f) for f in (*FRAMEWORKS, *HOOKS)):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert found == []


def test_each_hook_stands_on_the_replay_core_and_never_imports_the_other():
    for hook in HOOKS:
        folder = PACKAGE / hook.split(".")[1]
        imported = {m for path in folder.rglob("*.py") for m in imports_of(path)}
        assert any(_is_under(m, "torch_r3.replay") for m in imported), f"{hook} does not import torch_r3.replay"
        other = next(h for h in HOOKS if h != hook)
        crossing = sorted(m for m in imported if _is_under(m, other))
        assert crossing == [], f"{hook} imports the other hook: {crossing}"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of the import graph, each once, found by depth-first search from each module in turn."""
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(start: str, node: str, trail: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                key = frozenset(trail)
                if key not in seen:
                    seen.add(key)
                    cycles.append([*trail, start])
            elif nxt not in trail and nxt > start:  # each cycle from its smallest module only
                visit(start, nxt, [*trail, nxt])

    for start in sorted(graph):
        visit(start, start, [start])
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_no_module_of_the_package_is_part_of_an_import_cycle():
    graph = {
        _module_name(path): {m for m in imports_of(path) if _is_under(m, "torch_r3") and m != _module_name(path)}
        for path in _modules()
    }
    assert import_cycles(graph) == []


# The top level of the package holds its public modules and subpackages (private helpers live
# beside the capability they serve: torch_r3/collate/ for the collation kernel, torch_r3/rollout/
# for the codec, client, trace and health check). These private modules stay, each for its reason:
TOP_LEVEL_PRIVATE = {
    "_checks": "the argument rules every capability checks its callers' arguments by: one rule per kind of "
    "argument for the whole package, so it belongs to none of them",
    "_deprecation": "the one wording of every rename, in every capability",
    "_extras": "the optional-dependency import every capability with an extra goes through",
}


def test_the_top_level_holds_only_public_modules_subpackages_and_the_named_exceptions():
    private = sorted(
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if _is_private(p.stem if p.is_file() else p.name)
        and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))
    )
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    modules = [name for name in private if name not in packages]
    assert modules == sorted(TOP_LEVEL_PRIVATE), (
        f"private modules at the top level of torch_r3/: {modules}; move each beside the capability it serves "
        f"(a private subpackage such as torch_r3/collate/) or name it in TOP_LEVEL_PRIVATE with the reason"
    )
    for name in TOP_LEVEL_PRIVATE:  # an exception is one because several capabilities use it
        users = {
            _module_name(path).split(".")[1]
            for path in _modules()
            if f"torch_r3.{name}" in imports_of(path) and _module_name(path).count(".") >= 1
        }
        assert len(users) >= 3, f"torch_r3.{name} is used by {sorted(users)} only: move it beside them"


# ---------------------------------------------------------------------------
# Sizes: no module over 600 lines, no function body over 80 (issue 42 item 5)
# ---------------------------------------------------------------------------

MAX_MODULE_LINES = 600
MAX_BODY_LINES = 80


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines a function's body spans, from its first statement after the docstring to its last line."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def oversized(path: Path) -> list[str]:
    """`path`'s module if it is over `MAX_MODULE_LINES` lines, and each function whose body is over `MAX_BODY_LINES`."""
    text = path.read_text(encoding="utf-8")
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path.name}: {lines} lines")
    scopes: list[tuple[str, ast.AST]] = [("", ast.parse(text))]
    while scopes:
        prefix, scope = scopes.pop()
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                if not isinstance(node, ast.ClassDef) and body_lines(node) > MAX_BODY_LINES:
                    found.append(f"{path.name}: {name} body {body_lines(node)} lines (line {node.lineno})")
                scopes.append((f"{name}.", node))
            elif not isinstance(node, (ast.expr, ast.Import, ast.ImportFrom)):
                scopes.append((prefix, node))  # functions defined under an `if`, `try` or `with`
    return found


def test_the_size_scanner_counts_bodies_without_docstrings_nested_and_module_lines(tmp_path: Path) -> None:
    def function(name: str, statements: int, indent: str = "") -> str:
        inner = indent + "    "
        return f'{indent}def {name}():\n{inner}"""Doc\n{inner}string."""\n' + f"{inner}x = 1\n" * statements

    path = tmp_path / "m.py"
    path.write_text(function("fits", 80) + function("over", 81) + "class C:\n" + function("method", 81, "    "))
    assert sorted(oversized(path)) == ["m.py: C.method body 81 lines (line 169)", "m.py: over body 81 lines (line 84)"]
    # under an `if`, and nested: the outer body holds the inner function's 84 lines and its own one
    nested = "if True:\n    def outer():\n" + function("inner", 81, "        ") + "        return inner\n"
    path.write_text(nested + "x = 1\n" * (MAX_MODULE_LINES - nested.count("\n") + 1))
    assert sorted(oversized(path)) == [
        "m.py: 601 lines",
        "m.py: outer body 85 lines (line 2)",
        "m.py: outer.inner body 81 lines (line 3)",
    ]


def test_no_module_is_over_600_lines_and_no_function_body_over_80() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {hit.split(': ', 1)[1]}" for path in _modules() for hit in oversized(path)
    ]
    assert not found, "split these along their seams (no joined statements):\n" + "\n".join(found)
