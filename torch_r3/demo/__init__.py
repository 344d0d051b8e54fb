"""The demo: one RL step with routed-expert replay (R3), end to end, on one machine.

`torch-r3 demo` or `python -m torch_r3.demo [--trainer megatron|transformers]`.
`torch_r3.demo.common` holds what both trainers share and `run(cfg, trainer=)`;
`torch_r3.demo.options` is the command line above it and above the DSA variant
(`torch_r3.demo.dsa`); `torch_r3.demo.megatron` and `torch_r3.demo.transformers`
hold each trainer's side (models, served model, measurement). The common part
imports none of them, so the demo's import graph has no circle.
"""

from __future__ import annotations

from torch_r3.demo.common import (
    RUNS,
    TRAINERS,
    DemoConfig,
    DemoError,
    format_report,
    quiet_third_party_warnings,
    run,
)
from torch_r3.demo.options import build_parser, main, run_from_args

__all__ = [
    "RUNS",
    "TRAINERS",
    "DemoConfig",
    "DemoError",
    "build_parser",
    "format_report",
    "main",
    "quiet_third_party_warnings",
    "run",
    "run_from_args",
]
