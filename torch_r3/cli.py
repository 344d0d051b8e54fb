"""The ``torch-r3`` command line (also ``python -m torch_r3``).

Subcommands are registered in :data:`COMMANDS` as ``name -> (help, add_arguments,
run)``; each ``run`` imports what it needs lazily, so ``torch-r3 doctor`` does not
pay for matplotlib and a new subcommand is a few lines: two functions and one
entry.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["COMMANDS", "doctor_report", "main"]

# Exit codes: 0 ok, 1 a check failed at run time, 2 bad usage (argparse's), 3 not enough memory.
EXIT_MEMORY = 3


# --------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from torch_r3.bench import DISTRIBUTIONS, PRESETS, STRATEGIES

    shape = p.add_argument_group("batch shape (default: the headline shape, --preset default)")
    shape.add_argument("--preset", choices=sorted(PRESETS), default="default",
                       help="a named shape; explicit options below override it (production: 1024 sequences, "
                            "max 32768 tokens, topk 22, int16; checks that the memory it needs is available)")
    shape.add_argument("--num-sequences", type=_positive_int, help="trajectories per batch (default 256)")
    shape.add_argument("--max-seqlen", type=_positive_int, help="longest trajectory, tokens (default 8192)")
    shape.add_argument("--num-layers", type=_positive_int, help="MoE layers (default 40)")
    shape.add_argument("--topk", type=_positive_int, help="experts per token (default 8)")
    shape.add_argument("--num-experts", type=_positive_int,
                       help="experts per layer (default 128 for uint8; 256 or more forces int16)")
    shape.add_argument("--dtype", choices=("uint8", "int16", "int32"), help="route dtype (default: from --num-experts)")
    shape.add_argument("--distribution", choices=DISTRIBUTIONS, help="trajectory length distribution (default uniform)")
    shape.add_argument("--mixed-dtypes", action="store_true", help="mix uint8 and int16 senders in one batch")
    shape.add_argument("--seed", type=int, help="seed of the synthetic batch (default 0)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--repeats", type=_positive_int, help="timed runs per strategy (default 5)")
    timing.add_argument("--warmup", type=_positive_int, help="untimed runs per strategy first (default 1)")
    timing.add_argument("--workers", type=_positive_int, help="pool workers (default: torch_r3.cpu.pool_workers())")
    timing.add_argument("--strategies", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                        help="comma-separated subset of: " + ", ".join(STRATEGIES))
    timing.add_argument("--no-packed-compare", action="store_true",
                        help="skip the typical_rl packed-vs-padded comparison")
    timing.add_argument("--dataloader", action="store_true",
                        help="also time a real DataLoader with R3Collator: num_workers 0 and 2, pin_memory off "
                             "and on, fresh and recycled outputs, beside the memcpy floor")
    timing.add_argument("--batch-size", type=_positive_int,
                        help="trajectories per DataLoader batch for --dataloader (default 32)")
    timing.add_argument("--check-targets", action="store_true",
                        help="judge the project's speed targets on the default shape (implies --dataloader); "
                             "exit 1 when one is missed")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    out.add_argument("--plot", metavar="PATH",
                     help="write a PNG chart of time per strategy across a sweep of --num-sequences (needs matplotlib)")
    out.add_argument("--sweep", type=_int_list, metavar="N,N,...",
                     help="num_sequences points for --plot (default: n/8, n/4, n/2, n)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


_SHAPE_KEYS = ("num_sequences", "max_seqlen", "num_layers", "topk", "num_experts", "dtype", "distribution", "seed",
               "repeats", "warmup", "workers")


def _bench_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3 import bench

    settings: dict[str, Any] = dict(bench.PRESETS[args.preset])
    settings.update({k: getattr(args, k) for k in _SHAPE_KEYS if getattr(args, k) is not None})
    if args.mixed_dtypes:
        settings["mixed_dtypes"] = True
        if args.dtype is None and settings.get("dtype") == "uint8":
            settings["dtype"] = "int16"  # the widest sender's dtype
    if args.num_experts is not None and args.dtype is None:
        settings.pop("dtype", None)  # derived from the expert count
    strategies = args.strategies or list(bench.STRATEGIES)
    unknown = [s for s in strategies if s not in bench.STRATEGIES]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; choose from {', '.join(bench.STRATEGIES)}")
    if args.sweep and not args.plot:
        parser.error("--sweep only applies with --plot")
    try:
        config = bench.BenchConfig(**settings)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'torch_r3[bench]'")
    if args.check_targets:
        if not bench.is_default_shape(config):
            parser.error("--check-targets judges the default shape only; drop the shape options")
        missing = [s for s in (bench.BASELINE, bench.STEADY, bench.MEMCPY) if s not in strategies]
        if missing:
            parser.error(f"--check-targets needs the strategies {missing}")
    if args.batch_size is not None and not (args.dataloader or args.check_targets):
        parser.error("--batch-size only applies with --dataloader")
    batch_size = args.batch_size or bench.DEFAULT_BATCH_SIZE
    if (args.dataloader or args.check_targets) and batch_size > config.num_sequences:
        parser.error(f"--batch-size {batch_size} is larger than --num-sequences {config.num_sequences}")
    sweep = (args.sweep or bench.default_sweep(config.num_sequences)) if args.plot else None
    run_plan = bench.plan(config, strategies=strategies, packed_vs_padded=not args.no_packed_compare, sweep=sweep)
    need = bench.memory_needed(run_plan)
    try:
        bench.check_memory(need, config.label)
        print(f"torch-r3 bench: {config.label}; needs about {need / 2**30:.1f} GiB of memory", file=sys.stderr)
        result = bench.run(run_plan, dataloader_batch_size=batch_size if args.dataloader or args.check_targets
                           else None, progress=False if args.no_progress else None)
    except bench.InsufficientMemoryError as e:
        print(f"torch-r3 bench: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY
    print(bench.format_report(result))
    targets = bench.check_targets(result) if args.check_targets else None
    if targets is not None:
        print("\n" + bench.format_targets(targets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(targets), f, indent=2, allow_nan=False, default=_json_default)
            f.write("\n")
        print(f"torch-r3 bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        bench.plot_sweep(result, args.plot)
        print(f"torch-r3 bench: wrote {args.plot}", file=sys.stderr)
    return 1 if targets is not None and not bench.targets_met(targets) else 0


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


# --------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------


def _pinned_memory() -> tuple[bool, str]:
    import torch

    from torch_r3 import accelerator_available

    if not accelerator_available():
        return False, "no accelerator: pinning would not help, collate_routes uses plain memory"
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as e:
        return False, f"accelerator present but pinning failed: {e}"
    return True, "available: collate_routes pins its outputs in the main process"


def doctor_report() -> dict[str, Any]:
    """What ``torch-r3 doctor`` prints, as a dict (topology, threads, pinned memory, warnings)."""
    import torch

    from torch_r3.cpu import ENV_NUM_WORKERS, cpu_topology

    topo = cpu_topology()
    pinned, pinned_note = _pinned_memory()
    threads = torch.get_num_threads()
    warnings = []
    usable = topo["usable_cpus"]
    if threads * topo["pool_workers"] > usable:
        warnings.append(
            f"torch threads ({threads}) x pool workers ({topo['pool_workers']}) = {threads * topo['pool_workers']} "
            f"> usable CPUs ({usable:g}): when collation overlaps torch compute (or runs in several "
            f"DataLoader workers) the threads oversubscribe the CPUs; set OMP_NUM_THREADS / "
            f"torch.set_num_threads() or {ENV_NUM_WORKERS} so that their product fits"
        )
    if topo["affinity_cpus"] > math.floor(usable):
        warnings.append(
            f"the cgroup quota ({usable:g} CPUs) is below the affinity mask ({topo['affinity_cpus']} CPUs): "
            f"libraries that size their pools from os.cpu_count() or the affinity mask will be throttled"
        )
    return {**topo, "interop_threads": torch.get_num_interop_threads(), "pinned_memory": pinned,
            "pinned_memory_note": pinned_note, "warnings": warnings}


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _doctor_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3.cpu import ENV_NUM_WORKERS

    r = doctor_report()
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    quotas = r["cgroup_quotas"]
    lines = [
        "torch-r3 doctor: the CPU topology the collation pool sees",
        f"  affinity mask        {r['affinity_cpus']} CPUs (os.cpu_count() = {r['os_cpu_count']})",
    ]
    if quotas:
        for q in quotas:
            lines.append(f"  cgroup v{q['version']} quota     {q['cpus']:g} CPUs at {q['path']}")
    else:
        lines.append("  cgroup quota         none found (no cpu.max / cpu.cfs_quota_us limit on this cgroup path)")
    lines += [
        f"  usable CPUs          {r['usable_cpus']:g} (min of affinity and cgroup quota)",
        f"  pool workers         {r['pool_workers']}"
        + (f" (from {ENV_NUM_WORKERS}={r[ENV_NUM_WORKERS]})" if r[ENV_NUM_WORKERS] else
           " (min(8, floor(usable CPUs)))"),
        f"  torch threads        {r['torch_num_threads']} intra-op, {r['interop_threads']} inter-op "
        f"(OMP_NUM_THREADS={r['OMP_NUM_THREADS'] or 'unset'})",
        f"  pinned memory        {'yes' if r['pinned_memory'] else 'no'}: {r['pinned_memory_note']}",
    ]
    for w in r["warnings"]:
        lines.append(f"warning: {w}")
    if not r["warnings"]:
        lines.append("ok: no oversubscription found")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------
# demo: torch_r3.demo, one RL step end to end
# --------------------------------------------------------------------------


def _demo_module():
    from torch_r3 import demo

    return demo


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    _demo_module().build_parser(p)


def _demo_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return _demo_module().run_from_args(args)


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------

Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]

#: name -> (one-line help, add_arguments(parser), run(args, parser) -> exit code).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Runner]] = {
    "bench": ("time route collation strategies on a synthetic batch", _bench_arguments, _bench_run),
    "doctor": ("show the CPU topology, threads and pinned memory the collator sees", _doctor_arguments, _doctor_run),
    "demo": ("one RL step with R3 end to end: bf16 rollouts, R3Collator, fp32 Megatron step", _demo_arguments, _demo_run),
}


def _parser(wanted: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser; only the ``wanted`` subcommand gets its options (``demo`` loads the example for them)."""
    from torch_r3 import __version__

    parser = argparse.ArgumentParser(prog="torch-r3", description="Routed-expert replay (R3) tools.")
    parser.add_argument("--version", action="version", version=f"torch_r3 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, (help_text, add_arguments, _run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            add_arguments(p)
        subparsers[name] = p
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it).

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on bad usage, 3 when ``bench`` refuses for lack of memory.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser, subparsers = _parser(wanted)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    _help, _add, run = COMMANDS[args.command]
    return run(args, subparsers[args.command])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
