"""The `torch-r3` command line (also `python -m torch_r3`).

Subcommands are registered in `COMMANDS` as `name -> (help, add_arguments, run)`;
each `run` imports what it needs lazily, so `torch-r3 doctor` does not pay for
matplotlib and a new subcommand is a few lines: two functions and one entry.

Conventions shared by every subcommand: the report goes to stdout, status lines
(progress, "wrote PATH", refusals) go to stderr; `--json PATH` also writes the
full result as JSON to PATH; bare `torch-r3` prints the same help as
`torch-r3 --help` and exits 0.
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
    shape.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="a named shape; explicit options below override it (production: 1024 sequences, "
        "max 32768 tokens, topk 22, int16; checks that the memory it needs is available)",
    )
    shape.add_argument("--num-sequences", type=_positive_int, help="trajectories per batch (default 256)")
    shape.add_argument("--max-seqlen", type=_positive_int, help="longest trajectory, tokens (default 8192)")
    shape.add_argument("--num-layers", type=_positive_int, help="MoE layers (default 40)")
    shape.add_argument("--topk", type=_positive_int, help="experts per token (default 8)")
    shape.add_argument(
        "--num-experts", type=_positive_int, help="experts per layer (default 128 for uint8; 256 or more forces int16)"
    )
    shape.add_argument("--dtype", choices=("uint8", "int16", "int32"), help="route dtype (default: from --num-experts)")
    shape.add_argument("--distribution", choices=DISTRIBUTIONS, help="trajectory length distribution (default uniform)")
    shape.add_argument("--mixed-dtypes", action="store_true", help="mix uint8 and int16 senders in one batch")
    shape.add_argument("--seed", type=int, help="seed of the synthetic batch (default 0)")
    timing = p.add_argument_group("timing")
    timing.add_argument("--repeats", type=_positive_int, help="timed runs per strategy (default 5)")
    timing.add_argument("--warmup", type=_positive_int, help="untimed runs per strategy first (default 1)")
    timing.add_argument("--workers", type=_positive_int, help="pool workers (default: torch_r3.cpu.pool_workers())")
    timing.add_argument(
        "--strategies",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        help="comma-separated subset of: " + ", ".join(STRATEGIES),
    )
    timing.add_argument(
        "--no-packed-compare", action="store_true", help="skip the typical_rl packed-vs-padded comparison"
    )
    timing.add_argument(
        "--dataloader",
        action="store_true",
        help="also time a real DataLoader with R3Collator: num_workers 0 and 2, pin_memory off "
        "and on, fresh and recycled outputs, beside the memcpy and gather floors",
    )
    timing.add_argument(
        "--batch-size", type=_positive_int, help="trajectories per DataLoader batch for --dataloader (default 32)"
    )
    timing.add_argument(
        "--check-targets",
        action="store_true",
        help="judge the project's speed targets on the default shape (implies --dataloader); exit 1 when one is missed",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    out.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG chart of time per strategy across a sweep of --num-sequences (needs matplotlib)",
    )
    out.add_argument(
        "--sweep", type=_int_list, metavar="N,N,...", help="num_sequences points for --plot (default: n/8, n/4, n/2, n)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


_SHAPE_KEYS = (
    "num_sequences",
    "max_seqlen",
    "num_layers",
    "topk",
    "num_experts",
    "dtype",
    "distribution",
    "seed",
    "repeats",
    "warmup",
    "workers",
)


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
    dataloader = args.dataloader or args.check_targets  # the targets judge the DataLoader table too
    if args.batch_size is not None and not dataloader:
        parser.error("--batch-size only applies with --dataloader")
    batch_size = args.batch_size or bench.DEFAULT_BATCH_SIZE
    if dataloader and batch_size > config.num_sequences:
        parser.error(f"--batch-size {batch_size} is larger than --num-sequences {config.num_sequences}")
    sweep = (args.sweep or bench.default_sweep(config.num_sequences)) if args.plot else None
    run_plan = bench.plan(config, strategies=strategies, packed_vs_padded=not args.no_packed_compare, sweep=sweep)
    need = bench.memory_needed(run_plan)
    try:
        bench.check_memory(need, config.label)
        print(f"torch-r3 bench: {config.label}; needs about {need / 2**30:.1f} GiB of memory", file=sys.stderr)
        result = bench.run(
            run_plan,
            dataloader_batch_size=batch_size if dataloader else None,
            progress=False if args.no_progress else None,
        )
    except bench.InsufficientMemoryError as e:
        print(f"torch-r3 bench: refused: {e}", file=sys.stderr)
        return EXIT_MEMORY
    print(bench.format_report(result))
    targets = bench.check_targets(result) if args.check_targets else None
    if targets is not None:
        print("\n" + bench.format_targets(targets))
    if args.json:
        _write_json(args.json, result.to_json(targets), "bench")
    if args.plot:
        bench.plot_sweep(result, args.plot)
        print(f"torch-r3 bench: wrote {args.plot}", file=sys.stderr)
    return 1 if targets is not None and not bench.targets_met(targets) else 0


# --------------------------------------------------------------------------
# doctor
# --------------------------------------------------------------------------

# The distributions whose versions matter to a bug report, in report order.
_DISTRIBUTIONS = ("torch_r3", "torch", "numpy", "megatron-core", "aiohttp")


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _accelerator() -> dict[str, Any]:
    import torch

    from torch_r3._memory import accelerator_available

    available = accelerator_available()
    current = torch.accelerator.current_accelerator() if available and hasattr(torch, "accelerator") else None
    devices: list[str] = []
    if available and torch.cuda.is_available():
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    pinned, pinned_note = _pinned_memory(available)
    return {
        "available": available,
        "type": None if current is None else current.type,
        "devices": devices,
        "cuda_build": torch.version.cuda,
        "hip_build": torch.version.hip,
        "pinned_memory": pinned,
        "pinned_memory_note": pinned_note,
    }


def _pinned_memory(accelerator: bool) -> tuple[bool, str]:
    import torch

    if not accelerator:
        return False, "no accelerator: collate_routes uses plain memory (pinning would not help)"
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as e:
        return False, f"accelerator present but pinning failed: {e}"
    return True, "available: collate_routes pins its outputs in the main process"


def _cpu() -> dict[str, Any]:
    import torch

    from torch_r3.cpu import cpu_topology

    return {**cpu_topology(), "torch_interop_threads": torch.get_num_interop_threads()}


def _warnings(accelerator: dict[str, Any], cpus: dict[str, Any]) -> list[str]:
    """Only what needs fixing: a set-up with no quota and default settings gets none."""
    from torch_r3.cpu import DEFAULT_POOL_CAP, ENV_NUM_WORKERS

    usable = cpus["usable_cpus"]
    fit = max(1, math.floor(usable))
    out = []
    if cpus["torch_num_threads"] > usable:
        # torch sizes its pool from the affinity mask; a CFS quota below it throttles every op.
        out.append(
            f"torch runs {cpus['torch_num_threads']} intra-op threads on {usable:g} usable CPUs: the "
            f"threads are throttled; set OMP_NUM_THREADS={fit} (or torch.set_num_threads({fit}))"
        )
    if cpus["pool_workers_error"]:
        out.append(cpus["pool_workers_error"])
    elif cpus[ENV_NUM_WORKERS] and cpus["pool_workers"] > usable:
        out.append(
            f"{ENV_NUM_WORKERS}={cpus[ENV_NUM_WORKERS]} asks for more collation threads than the "
            f"{usable:g} usable CPUs: unset it (the default is min({DEFAULT_POOL_CAP}, {fit})) or lower it"
        )
    if accelerator["available"] and not accelerator["pinned_memory"]:
        out.append(accelerator["pinned_memory_note"])
    return out


def doctor_report() -> dict[str, Any]:
    """What `torch-r3 doctor` reports, as a dict that `json.dumps` accepts.

    Returns:
        `versions` (distribution -> version, `None` when not installed; plus `python`
        and `platform`), `accelerator` (availability, devices, CUDA/HIP build, pinned
        memory), `cpu` (affinity mask, cgroup quotas, usable CPUs, pool workers, thread
        settings) and `warnings` (what to fix; empty on a set-up that needs nothing).
    """
    import platform

    versions: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    versions.update({name: _version(name) for name in _DISTRIBUTIONS})
    accelerator = _accelerator()
    cpus = _cpu()
    return {"versions": versions, "accelerator": accelerator, "cpu": cpus, "warnings": _warnings(accelerator, cpus)}


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


def _doctor_text(r: dict[str, Any]) -> str:
    from torch_r3.cpu import DEFAULT_POOL_CAP, ENV_NUM_WORKERS

    def row(name: str, value: object) -> str:
        return f"  {name:<20} {value}"

    acc, cpus = r["accelerator"], r["cpu"]
    lines = ["versions"] + [row(k, v or "not installed") for k, v in r["versions"].items()]
    build = ", ".join(f"{k} {v}" for k, v in (("CUDA", acc["cuda_build"]), ("HIP", acc["hip_build"])) if v)
    lines += [
        "accelerator",
        row(
            "available",
            f"yes ({acc['type']}: {', '.join(acc['devices']) or 'no device names'})" if acc["available"] else "no",
        ),
        row("torch built with", build or "no CUDA or HIP (CPU build)"),
        row("pinned memory", f"{'yes' if acc['pinned_memory'] else 'no'}: {acc['pinned_memory_note']}"),
        "CPU (what the collation pool sees)",
        row("affinity mask", f"{cpus['affinity_cpus']} CPUs (os.cpu_count() = {cpus['os_cpu_count']})"),
    ]
    for q in cpus["cgroup_quotas"]:
        lines.append(row(f"cgroup v{q['version']} quota", f"{q['cpus']:g} CPUs at {q['path']}"))
    if not cpus["cgroup_quotas"]:
        lines.append(row("cgroup quota", "none found (no cpu.max / cpu.cfs_quota_us limit on this cgroup path)"))
    workers = cpus["pool_workers"]
    source = (
        f"from {ENV_NUM_WORKERS}={cpus[ENV_NUM_WORKERS]}"
        if cpus[ENV_NUM_WORKERS]
        else f"min({DEFAULT_POOL_CAP}, floor(usable CPUs))"
    )
    lines += [
        row("usable CPUs", f"{cpus['usable_cpus']:g} (min of affinity mask and cgroup quota)"),
        row("pool workers", f"{workers} ({source})" if workers is not None else f"invalid ({source})"),
        row(
            "torch threads",
            f"{cpus['torch_num_threads']} intra-op, {cpus['torch_interop_threads']} inter-op "
            f"(OMP_NUM_THREADS={cpus['OMP_NUM_THREADS'] or 'unset'})",
        ),
    ]
    lines += [f"warning: {w}" for w in r["warnings"]] or ["ok: nothing to fix"]
    return "\n".join(lines)


def _doctor_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    report = doctor_report()
    print(_doctor_text(report))
    if args.json:
        _write_json(args.json, report, "doctor")
    return 0


# --------------------------------------------------------------------------
# demo: torch_r3.demo, one RL step end to end
# --------------------------------------------------------------------------

# What the demo imports beyond the core, and the extra that installs it.
_DEMO_NEEDS = (("megatron.core", "megatron"), ("aiohttp", "client"))


def _demo_module():
    from torch_r3 import demo

    return demo


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from torch_r3._extras import MissingExtraError

    try:  # the demo module imports the loopback server, hence aiohttp
        _demo_module().build_parser(p)
    except MissingExtraError:
        pass  # no options then: `_demo_run` names the extra to install


def _demo_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3._extras import MissingExtraError, require

    try:
        demo = _demo_module()
        # Megatron's import-time fallback notices (no Apex, no Transformer Engine)
        # say nothing to a demo user: the imports run inside the demo's filter too.
        with demo.quiet_third_party_warnings():
            for module, extra in _DEMO_NEEDS:
                require(module, extra)
    except MissingExtraError as e:
        extras = ",".join(extra for _module, extra in _DEMO_NEEDS)
        print(
            f"torch-r3 demo: {e.distribution} is not installed; the demo needs pip install 'torch_r3[{extras}]'",
            file=sys.stderr,
        )
        return 2
    with demo.quiet_third_party_warnings():
        return demo.run_from_args(args)


# --------------------------------------------------------------------------
# Shared conventions: reports on stdout, status lines on stderr
# --------------------------------------------------------------------------


def _write_json(path: str, data: Any, command: str) -> None:
    """`--json PATH` in every subcommand: write `data` to PATH, say so on stderr."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")
    print(f"torch-r3 {command}: wrote {path}", file=sys.stderr)


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------

Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]

#: name -> (one-line help, add_arguments(parser), run(args, parser) -> exit code).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Runner]] = {
    "bench": ("time route collation strategies on a synthetic batch", _bench_arguments, _bench_run),
    "doctor": (
        "show versions, accelerator, pinned memory and the CPUs the collator sees",
        _doctor_arguments,
        _doctor_run,
    ),
    "demo": (
        "one RL step with R3 end to end: bf16 rollouts, R3Collator, fp32 Megatron step",
        _demo_arguments,
        _demo_run,
    ),
}


def _parser(wanted: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser; only the `wanted` subcommand gets its options (`demo` imports its module for them)."""
    from torch_r3 import __version__

    parser = argparse.ArgumentParser(
        prog="torch-r3",
        description="Routed-expert replay (R3) tools.",
        epilog="Every subcommand prints its report on stdout and status lines on stderr; "
        "--json PATH also writes the full result as JSON to PATH. "
        "'torch-r3 COMMAND --help' lists a subcommand's options.",
    )
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
    """Run the command line; the console script exits with what it returns.

    Args:
        argv: the arguments after the program name (default `sys.argv[1:]`).

    Returns:
        The exit code: 0 on success (bare `torch-r3` included: it prints the help),
        2 on bad usage or a missing extra, 3 when `bench` refuses for lack of memory.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser, subparsers = _parser(wanted)
    args = parser.parse_args(argv)
    if args.command is None:  # the same help, stream and status as --help
        parser.print_help()
        return 0
    _help, _add, run = COMMANDS[args.command]
    return run(args, subparsers[args.command])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
