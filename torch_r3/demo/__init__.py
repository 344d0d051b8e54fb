"""The demo: one RL step with routed-expert replay (R3), end to end, on one machine.

`torch-r3 demo` or `python -m torch_r3.demo [--trainer megatron|transformers]`.
`torch_r3.demo.common` holds what both trainers share and `run(cfg, trainer=)`,
`torch_r3.demo.cli` the command line above it and the DSA variant (`torch_r3.demo.dsa`);
`torch_r3.demo.megatron` and `torch_r3.demo.transformers` hold each trainer's
side (models, served model, measurement). The common part imports neither.
"""

from __future__ import annotations

from torch_r3.demo.cli import main, run_from_args
from torch_r3.demo.common import (
    RUNS,
    TRAINERS,
    DemoConfig,
    DemoError,
    build_parser,
    format_report,
    quiet_third_party_warnings,
    run,
)

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
