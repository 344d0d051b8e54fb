"""Every runnable example in the package's docstrings is true, each run once.

Modules are discovered, not listed: a new module's examples run without an edit here.
A module whose optional dependency is missing (its extra is not installed) is skipped,
with the reason it gives.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import torch_r3
from torch_r3._extras import MissingExtraError

# `python -m torch_r3` and `python -m torch_r3.demo` run their command line on import.
NOT_IMPORTABLE = {"torch_r3.__main__", "torch_r3.demo.__main__"}
MODULES = sorted(
    ["torch_r3"]
    + [m.name for m in pkgutil.walk_packages(torch_r3.__path__, "torch_r3.") if m.name not in NOT_IMPORTABLE]
)


def test_discovery_finds_the_modules_whose_examples_were_never_run_before():
    assert {
        "torch_r3.collate",
        "torch_r3.rollout.codec",
        "torch_r3.megatron.slicing",
        "torch_r3.testing.server",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    try:
        module = importlib.import_module(name)
    except MissingExtraError as e:
        pytest.skip(str(e))
    # The finder only takes objects defined in `module`: a re-exported name runs once, at home.
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
