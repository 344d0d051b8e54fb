"""The public surface is what the API pages render, no more and no less.

The API reference (`docs/api/*.md`) renders objects with mkdocstrings
directives: `::: torch_r3.collate_routes` renders one object, `::: torch_r3.rollout.codec`
with `members: [...]` renders the module and the listed names, and
`members: false` only the module's docstring. A module's `__all__` is its
public surface. These tests hold the two together, for every public module the
package has (found on disk, so a subpackage added later is covered without
editing this file) and every API page (found by glob, likewise):

* every name a page renders is in the `__all__` of the module it is rendered
  from: a page never documents an internal;
* every name in a public module's `__all__` is rendered on some page, under
  that module or under any other path to the same object (the top level
  re-exports names documented with their home module): nothing public is
  undocumented;
* a module directive says which members it renders, so that what a page shows
  is read from the page, not from mkdocstrings' defaults; a page may show a
  private module's docstring as prose (`members: false`,
  `show_root_heading: false`), which names nothing to import;
* what the guides and README import from `torch_r3` is public, so removing a
  name from `__all__` cannot break a reader who followed the docs.

Public modules are those whose dotted path has no component starting with `_`.
A module whose optional dependency is not installed is skipped with the reason.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch_r3"
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
# Pages whose code users copy: what they import from torch_r3 must stay importable and public.
READER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# Command-line programs: users run them (`torch-r3 ...`, `python -m torch_r3.bench`) and the
# guides document them as commands, not as Python API, so their `__all__` is not on an API page.
COMMAND_MODULES = (
    "torch_r3.__main__",
    "torch_r3.bench",
    "torch_r3.cli",
    "torch_r3.demo",
    "torch_r3.demo.common",
    "torch_r3.demo.megatron",  # `torch-r3 demo`
    "torch_r3.demo.transformers",  # `torch-r3 demo --trainer transformers`
    "torch_r3.doctor",
)

_DIRECTIVE = re.compile(r"^::: *(?P<path>[\w.]+) *$")


def _public_modules() -> list[str]:
    """Every importable module of the package with no private path component, found on disk."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if any(part.startswith("_") for part in parts):
            continue
        name = ".".join(parts)
        if any(name == command or name.startswith(command + ".") for command in COMMAND_MODULES):
            continue
        names.append(name)
    return names


PUBLIC_MODULES = _public_modules()


def _import(name: str) -> ModuleType:
    """Import a module of the package, skipping when an optional dependency it needs is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # MissingExtraError is one; a missing torch_r3 module is a real failure
        if exc.name is not None and (exc.name == "torch_r3" or exc.name.startswith("torch_r3.")):
            raise
        pytest.skip(f"{name} needs an optional dependency that is not installed: {exc}")


class Rendered(NamedTuple):
    """One name a page renders: `module.name`, as written at `page:line`."""

    module: str
    name: str
    where: str


class Directive(NamedTuple):
    path: str
    members: Any  # a list of names, False, or None when the directive does not say
    where: str
    prose_only: bool  # `members: false` and no heading: the module's docstring as page text


def _options(block: list[str]) -> tuple[Any, bool]:
    """`members` (a list, `False`, or `None` when unsaid or in another form) and whether
    `show_root_heading: false`, from the YAML block under a directive.

    Read with a few patterns rather than a YAML parser, which the test extra does not
    install; the pages use only these forms (`members: false`, a `- name` list).
    """
    members: Any = None
    no_heading = False
    for i, line in enumerate(block):
        key, _, value = line.strip().partition(":")
        if key == "members" and value.strip() == "false":
            members = False
        elif key == "members" and value.strip() == "":
            members = []
            for item in block[i + 1 :]:
                match = re.fullmatch(r"\s*- *(\w+)\s*", item)
                if match is None:
                    break
                members.append(match[1])
        elif key == "show_root_heading" and value.strip() == "false":
            no_heading = True
    return members, no_heading


def _directives(page: Path) -> list[Directive]:
    """The `:::` directives of a page, each with its `options` (the indented block under it)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _DIRECTIVE.match(line)
        if match is None:
            continue
        block = []
        for following in lines[i + 1 :]:
            if following.strip() and not following.startswith(" "):
                break
            block.append(following)
        members, no_heading = _options(block)
        prose_only = members is False and no_heading
        found.append(Directive(match["path"], members, f"{page.relative_to(ROOT)}:{i + 1}", prose_only))
    return found


ALL_DIRECTIVES = [d for page in API_PAGES for d in _directives(page)]


def _is_module(path: str) -> bool:
    try:
        importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name == path:  # the path names an attribute of its parent, not a module
            return False
        raise
    return True


def _rendered(directive: Directive) -> list[Rendered]:
    """The module-level names a directive renders (a class's methods are the class's, not the module's)."""
    if _is_module(directive.path):
        if not isinstance(directive.members, list):  # `false`, or unsaid (its own test fails then)
            return []
        return [Rendered(directive.path, name, directive.where) for name in directive.members]
    module, _, name = directive.path.rpartition(".")
    return [Rendered(module, name, directive.where)]


def _directive_id(directive: Directive) -> str:
    return f"{directive.where}:{directive.path}"


@pytest.mark.parametrize("directive", ALL_DIRECTIVES, ids=_directive_id)
def test_a_module_directive_says_which_members_it_renders(directive):
    try:
        is_module = _is_module(directive.path)
    except ImportError as exc:
        pytest.skip(f"{directive.path} needs an optional dependency that is not installed: {exc}")
    if not is_module:
        return
    members = directive.members
    assert members is False or (isinstance(members, list) and all(isinstance(m, str) for m in members)), (
        f"{directive.where}: `::: {directive.path}` must list its members (`members: [...]`) or say "
        f"`members: false`; got {members!r}, which leaves what the page renders to mkdocstrings' defaults"
    )


@pytest.mark.parametrize("directive", ALL_DIRECTIVES, ids=_directive_id)
def test_every_name_a_page_renders_is_in_its_module_all(directive):
    try:
        rendered = _rendered(directive)
    except ImportError as exc:
        pytest.skip(f"{directive.path} needs an optional dependency that is not installed: {exc}")
    owner = directive.path if not rendered else rendered[0].module
    if directive.prose_only:
        return  # a private module's docstring as prose (no heading, no names): it exposes no path
    assert owner in PUBLIC_MODULES or owner == "torch_r3", (
        f"{directive.where}: `::: {directive.path}` documents {owner}, which is not a public module"
    )
    module = _import(owner)
    public = set(getattr(module, "__all__", ()))
    internal = [r.name for r in rendered if r.name not in public]
    assert not internal, f"{directive.where}: renders {internal}, not in {owner}.__all__ (internals stay off the pages)"
    for r in rendered:
        getattr(module, r.name)  # the page names something that exists


@functools.cache
def _rendered_objects() -> list[tuple[str, Any]]:
    """(name, object) for every name rendered on some page whose module imports here."""
    objects = []
    for directive in ALL_DIRECTIVES:
        try:
            rendered = _rendered(directive)
            for r in rendered:
                objects.append((r.name, getattr(importlib.import_module(r.module), r.name)))
        except ImportError:
            continue  # its own test skips it with the reason
    return objects


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_a_public_module_declares_its_surface(name):
    module = _import(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__ list: its surface is unstated"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which the module does not define"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_rendered_on_an_api_page(name):
    module = _import(name)
    rendered = _rendered_objects()
    # Same name and same object: a re-export is documented where its home module is.
    undocumented = [
        n
        for n in getattr(module, "__all__", ())
        if not any(r == n and obj is getattr(module, n) for r, obj in rendered)
    ]
    assert not undocumented, (
        f"{name}.__all__ exports {undocumented}, rendered on no page of docs/api/: document them or make them internal"
    )


def _code_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.M | re.S)


def _imports_from_the_package(source: str) -> list[tuple[str, str]]:
    """(module, name) for each `from torch_r3[.x] import name` and `torch_r3.name` in the code."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a fragment (`<!-- not run -->`): read its import lines alone
        lines = [line.strip() for line in source.splitlines() if re.match(r"\s*(from|import) torch_r3\b", line)]
        tree = ast.parse("\n".join(line for line in lines if not line.endswith("(")))
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch_r3":
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch_r3":
            found.append(("torch_r3", node.attr))
    return found


def _reader_imports() -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    for page in READER_PAGES:
        for block in _code_blocks(page):
            found.extend(
                (module, name, str(page.relative_to(ROOT))) for module, name in _imports_from_the_package(block)
            )
    for example in EXAMPLES:
        source = example.read_text(encoding="utf-8")
        found.extend((m, n, str(example.relative_to(ROOT))) for m, n in _imports_from_the_package(source))
    return found


def test_what_the_docs_import_from_torch_r3_is_public():
    imports = _reader_imports()
    assert any(module == "torch_r3" for module, _, _ in imports)  # the scan reads the pages' code at all
    broken = []
    for module_name, name, where in imports:
        if module_name not in PUBLIC_MODULES and module_name != "torch_r3":
            continue  # a command module (`torch_r3.demo`) or a private one: not API
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if isinstance(getattr(module, name, None), ModuleType) or (
            hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{name}")
        ):
            continue  # `torch_r3.testing` used as a module (`from torch_r3 import bench` imports the subpackage)
        if name not in getattr(module, "__all__", ()):
            broken.append(f"{where}: {module_name}.{name}")
    assert not broken, f"the docs use names that are not public: {broken}"


def test_top_level_all_is_what_the_package_resolves():
    import torch_r3

    assert sorted(torch_r3.__all__) == sorted(set(torch_r3.__all__)), "torch_r3.__all__ repeats a name"
    assert set(torch_r3.__all__) <= set(dir(torch_r3))
    for name in torch_r3.__all__:
        assert getattr(torch_r3, name) is not None


# The internals issue 20 found at the top level: codec and memory helpers, the trace's row store.
@pytest.mark.parametrize("name", ["decode_npy", "base64_decoded_length", "accelerator_available", "TokenMetadataTrace"])
def test_internals_are_not_at_the_top_level(name):
    import torch_r3

    assert name not in torch_r3.__all__
    with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
        getattr(torch_r3, name)


@pytest.fixture(scope="module")
def api_html(built_site: Path) -> dict[str, str]:
    """The built API pages (`docs/api/x.md` -> its HTML), the reference for what the directives render."""
    pages = (built_site / "api").glob("*/index.html")
    return {f"docs/api/{p.parent.name}.md": p.read_text(encoding="utf-8") for p in pages}


def _module_level_anchors(html: str) -> set[tuple[str, str]]:
    """(module, name) of each object heading mkdocstrings wrote whose parent is a module."""
    found = set()
    for anchor in re.findall(r'id="(torch_r3(?:\.\w+)+)"', html):
        parent, _, name = anchor.rpartition(".")
        try:
            if _is_module(parent) and not _is_module(anchor):  # a module's own heading is not a name in it
                found.add((parent, name))
        except ImportError:
            continue
    return found


@pytest.mark.parametrize("page", API_PAGES, ids=lambda p: p.name)
def test_the_built_page_renders_exactly_the_names_its_directives_list(page, api_html):
    key = str(page.relative_to(ROOT))
    built = _module_level_anchors(api_html[key])
    parsed = set()
    for directive in _directives(page):
        try:
            parsed |= {(r.module, r.name) for r in _rendered(directive)}
        except ImportError:
            continue
    assert parsed - built == set(), f"{key}: listed but not rendered (no docstring?): {sorted(parsed - built)}"
    assert built - parsed == set(), f"{key}: rendered but not read from the directives: {sorted(built - parsed)}"
