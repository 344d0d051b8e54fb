"""The demo's command line: `python -m torch_r3.demo` and `torch-r3 demo`.

It sits above the modules it dispatches to, `torch_r3.demo.common` (the step
both trainers share, `run(cfg, trainer=)`, and the parser) and the
sparse-attention variant `torch_r3.demo.dsa`, which is built on the common
part; neither of them imports this one, so the demo's import graph has no
circle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from torch_r3.demo.common import DemoConfig, DemoError, build_parser, format_report, run, write_run_log

__all__ = ["main", "run_from_args"]


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options (``torch-r3 demo`` shares the parser); returns the exit code."""
    for name in ("trajectories", "turns", "retries"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            return 2
    if getattr(args, "dsa", False):
        return _run_dsa_from_args(args)
    cfg = DemoConfig(seed=args.seed, trajectories=args.trajectories, turns=args.turns)
    try:
        results = run(
            cfg,
            trainer=getattr(args, "trainer", "megatron"),
            server_url=args.server_url,
            retries=args.retries,
            num_workers=args.num_workers,
            quiet=args.quiet,
        )
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(results, cfg))
    if getattr(args, "run_log", None):
        write_run_log(args.run_log, results, trainer=getattr(args, "trainer", "megatron"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _run_dsa_from_args(args: argparse.Namespace) -> int:
    """`--dsa`: the sparse-attention variant (`torch_r3.demo.dsa`), its own report and JSON."""
    from torch_r3.demo import dsa  # here, not at the top: it imports transformers' DeepSeek-V3.2 model

    if args.server_url or getattr(args, "run_log", None):
        print("error: --dsa runs its own loopback server and writes no run log", file=sys.stderr)
        return 2
    cfg = dsa.DSAConfig(seed=args.seed, trajectories=args.trajectories, turns=args.turns)
    try:
        results = dsa.run_dsa(cfg, quiet=args.quiet)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dsa.format_dsa_report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
