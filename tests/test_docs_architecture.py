"""The architecture page says what the code is: its figure is the script's, it names every
folder of the package, and its layer list is the one `tests/test_layering.py` enforces."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "torch_r3"


def _script():
    spec = importlib.util.spec_from_file_location("make_data_path", ROOT / "docs" / "img" / "make_data_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_data_path_figure_is_what_its_script_draws_and_names_each_stage():
    script = _script()
    committed = (ROOT / "docs" / "img" / "data-path.svg").read_text(encoding="utf-8")
    assert committed == script.svg(), "docs/img/data-path.svg is stale: run python docs/img/make_data_path.py"
    assert "](img/data-path.svg)" in PAGE.read_text()
    titles = [title for title, _, _ in script.STAGES]
    assert titles == ["inference engine", "rollout", "health", "collate", "replay", "trainer"]
    for stage in ("rollout", "health", "collate", "replay"):
        assert f">torch_r3.{stage}<" in committed


def _folder_table() -> str:
    text = PAGE.read_text()
    start = text.index("## Each folder's job")
    return text[start : text.index("\n## ", start + 1)]


def test_the_page_gives_every_folder_and_public_top_level_module_a_line():
    table = _folder_table()
    named = set(re.findall(r"`torch_r3\.([a-z_]+)`", table))
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    missing = sorted((folders | modules) - named)
    assert not missing, f"docs/architecture.md names no job for torch_r3.{missing}"
    assert not sorted(named - folders - modules), "the page names a folder or module the package does not have"


def test_the_layer_list_is_the_one_the_layering_test_enforces():
    text = PAGE.read_text()
    section = text[text.index("## The layer rule") :]
    listed = re.findall(r"^\d+\. (.+)$", section, re.M)
    names = [re.findall(r"\*\*([a-z]+)\*\*", line) for line in listed]
    expected = [name for name, _ in LAYERS]
    flat = [n for group in names for n in group]
    assert flat == expected, (flat, expected)
    for line, group in zip(listed, names):
        for name in group:
            for prefix in dict(LAYERS)[name]:
                short = prefix.removeprefix("torch_r3.")
                assert short in line, f"layer {name}: the page's line {line!r} does not name {prefix}"
