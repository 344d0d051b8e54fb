"""A `RequestOutput` as a given vLLM release's object, for the in-process reader's version rules.

`torch_r3.rollout.inprocess` tells a vLLM that has no `routed_experts_prompt_start`
(before 0.22) by the `__version__` of the `vllm` package that defined the
output's class. The released wheels' fields are in `tests/fixtures/vllm_versions.json`;
this gives an output of those fields the class of that release's package.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest


def release_output(monkeypatch: pytest.MonkeyPatch, version: str, output: SimpleNamespace) -> object:
    """`output` as an object of a class from a `vllm` package of `version` (the reader reads the version only)."""
    package = types.ModuleType("vllm")
    package.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", package)
    cls = type("RequestOutput", (SimpleNamespace,), {"__module__": "vllm.outputs"})
    return cls(**vars(output))
