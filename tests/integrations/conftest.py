"""The integration tests run in `.venv-frameworks` (`make frameworks`), where SkyRL and verl are installed.

Elsewhere every test here is skipped. The Megatron fixtures of `tests/megatron`
are shared: its directory is put on the path for `_models`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import importlib.util

if importlib.util.find_spec("megatron") is not None:
    # The Megatron suite's fixtures (a gloo world of one, Megatron on the CPU), from their one home.
    _spec = importlib.util.spec_from_file_location(
        "megatron_suite_conftest", Path(__file__).resolve().parents[1] / "megatron" / "conftest.py"
    )
    assert _spec is not None and _spec.loader is not None
    _suite = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_suite)
    world_of_one = _suite.world_of_one
    cpu_megatron = _suite.cpu_megatron
