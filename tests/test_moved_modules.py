"""The 0.3.0 house move: every old import path still answers, for one release, with
the very module object of its new home and one DeprecationWarning that names the
new path on the user's own line (torch_r3._deprecation.MOVED_MODULES)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import torch_r3  # noqa: F401  (installs the aliases)
from torch_r3._deprecation import MOVED_MODULES, moved_module

# The table, written out again by hand: the move this test holds the code to.
EXPECTED = {
    "torch_r3.client": "torch_r3.rollout.client",
    "torch_r3.transport": "torch_r3.rollout.transport",
    "torch_r3.codec": "torch_r3.rollout.codec",
    "torch_r3.trace": "torch_r3.rollout.trace",
    "torch_r3.inprocess": "torch_r3.rollout.inprocess",
    "torch_r3.protocols": "torch_r3.rollout.protocols",
    "torch_r3.layout": "torch_r3.collate.layout",
    "torch_r3.geometry": "torch_r3.collate.geometry",
    "torch_r3.shard": "torch_r3.collate.shard",
    "torch_r3.nested": "torch_r3.collate.nested",
    "torch_r3.stats": "torch_r3.replay.stats",
    "torch_r3.indexer.encoding": "torch_r3.selections",
    "torch_r3.indexer.wire": "torch_r3.rollout.selections_wire",
    "torch_r3.indexer.turns": "torch_r3.rollout.selections_trace",
    "torch_r3.indexer.collate": "torch_r3.collate.selections",
    "torch_r3.indexer.checks": "torch_r3.replay.selection_checks",
    "torch_r3.indexer.stats": "torch_r3.replay.selection_stats",
    "torch_r3.indexer.transformers": "torch_r3.transformers.indexer",
    "torch_r3.integrations.skyrl.swap": "torch_r3.integrations.skyrl.install",
}


def test_the_alias_table_is_the_documented_move():
    assert MOVED_MODULES == EXPECTED


def _import_fresh(name: str):
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, seen


@pytest.mark.parametrize("old", sorted(EXPECTED))
def test_an_old_path_is_the_new_module_with_one_warning_naming_it(old):
    new = importlib.import_module(EXPECTED[old])
    module, seen = _import_fresh(old)
    assert module is new
    moved = [w for w in seen if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in seen]
    assert EXPECTED[old] in str(moved[0].message)
    # The new module keeps its own identity.
    assert module.__name__ == EXPECTED[old]
    assert module.__spec__.name == EXPECTED[old]


def test_a_moved_packages_submodule_answers_from_the_new_package():
    new = importlib.import_module("torch_r3.rollout.protocols.sglang")
    module, seen = _import_fresh("torch_r3.protocols.sglang")
    assert module is new
    assert any("torch_r3.rollout.protocols.sglang" in str(w.message) for w in seen)
    assert moved_module("torch_r3.protocols.sglang") == "torch_r3.rollout.protocols.sglang"
    assert moved_module("torch_r3.collate") is None
    assert moved_module("torch_r3.clientx") is None


@pytest.mark.parametrize("old", ["torch_r3.client", "torch_r3.indexer.checks", "torch_r3.layout"])
def test_the_warning_points_at_the_users_import_line_and_from_imports_work(old, tmp_path):
    # A fresh interpreter: `import`, `from ... import` and the warning's file and line.
    name = old.rsplit(".", 1)[1]
    script = tmp_path / "user_code.py"
    script.write_text(
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "import torch_r3\n"
        "try:\n"
        f"    import {old}\n"
        "except DeprecationWarning as exc:\n"
        "    print('RAISED', exc)\n"
        "warnings.simplefilter('ignore')\n"
        f"from {old.rsplit('.', 1)[0]} import {name} as old_module\n"
        "import importlib\n"
        f"assert old_module is importlib.import_module({EXPECTED[old]!r})\n"
        "warnings.resetwarnings()\n"
        "warnings.simplefilter('always')\n"
        "import sys\n"
        f"del sys.modules[{old!r}]\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    importlib.import_module({old!r})\n"
        "w = [x for x in seen if issubclass(x.category, DeprecationWarning)][0]\n"
        "print('AT', w.filename, w.lineno)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"RAISED {old} moved to {EXPECTED[old]}" in done.stdout
    # importlib.import_module is the caller here: the report names the user's script, line 18.
    assert f"AT {script} 18" in done.stdout, done.stdout


def test_the_new_homes_import_without_any_warning():
    code = (
        "import warnings, importlib\n"
        "warnings.simplefilter('error')\n"
        f"for name in {sorted(set(EXPECTED.values()))!r}:\n"
        "    importlib.import_module(name)\n"
        "import torch_r3, torch_r3.indexer, torch_r3.rollout, torch_r3.collate, torch_r3.health, torch_r3.replay\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_import_statements_of_old_paths_warn_on_their_own_lines(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch_r3\n"
        "import torch_r3.transport\n"
        "from torch_r3.indexer import stats\n"
        "from torch_r3 import geometry\n"
        "from torch_r3.protocols.vllm import VLLMProtocol\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for line, old in [(2, "torch_r3.transport"), (3, "torch_r3.indexer.stats"), (4, "torch_r3.geometry")]:
        assert f"{script}:{line}: DeprecationWarning: {old} moved to {EXPECTED[old]}" in done.stderr, done.stderr
    assert f"{script}:5: DeprecationWarning: torch_r3.protocols moved to torch_r3.rollout.protocols" in done.stderr
