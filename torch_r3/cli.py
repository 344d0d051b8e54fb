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

import _thread
import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from torch_r3.doctor import doctor_report  # re-exported: the report behind `torch-r3 doctor`

__all__ = ["COMMANDS", "doctor_report", "main"]

# Exit codes: 0 ok, 1 a check failed at run time, 2 bad usage (argparse's), 3 not enough memory,
# 130 interrupted (Ctrl-C, as a shell reports SIGINT).
EXIT_MEMORY = 3
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (the full usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _CtrlC:
    """Ctrl-C during a subcommand, never lost: the exit status says so even when Python drops it.

    Python raises `KeyboardInterrupt` wherever the main thread is; inside a
    finaliser (`__del__`, a `weakref.finalize` callback, which the buffer pool
    runs all the time) it only prints "Exception ignored" and carries on. So
    the handler records the press and delivers it again shortly, until it
    lands in code that lets it through; `main` also checks the record after
    the run. A process started with SIGINT ignored (a background job of a
    non-interactive shell) keeps ignoring it, as POSIX has it.
    """

    REDELIVER_S = 0.2

    def __init__(self) -> None:
        self.pressed = False
        self._timer: threading.Timer | None = None
        self._previous: Any = None

    def __enter__(self) -> _CtrlC:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.pressed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.REDELIVER_S, _thread.interrupt_main)
        self._timer.daemon = True
        self._timer.start()
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _check_writable(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """Refuse, before any set-up, an output path that could never be written."""
    if path is None:
        return
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        parser.error(f"{option} {path}: is a directory, expected a file path")
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: the directory {folder} is not writable")


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
    from torch_r3.bench import DISTRIBUTIONS, PRESETS, SERIAL, STRATEGIES, registered

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
        help="comma-separated, in run order (default: torch_r3's own and the floors: "
        + ", ".join(STRATEGIES)
        + "); also any registered with torch_r3.bench.register"
        + "".join(f", {s}" for s in registered() if s not in STRATEGIES)
        + " (a checkout's python -m benchmarks.compare adds the peers' collations)",
    )
    timing.add_argument(
        "--speedup-over",
        metavar="STRATEGY",
        help=f"the strategy the speed-up column is taken over (default {SERIAL!r}, torch_r3's kernel on one "
        "thread); the column is left out when it does not run",
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


def _bench_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `BenchConfig` keywords: the preset's, overridden by the shape options given."""
    from torch_r3 import bench

    settings: dict[str, Any] = dict(bench.PRESETS[args.preset])
    settings.update({k: getattr(args, k) for k in _SHAPE_KEYS if getattr(args, k) is not None})
    if args.mixed_dtypes:
        settings["mixed_dtypes"] = True
        if args.dtype is None and settings.get("dtype") == "uint8":
            settings["dtype"] = "int16"  # the widest sender's dtype
    if args.num_experts is not None and args.dtype is None:
        settings.pop("dtype", None)  # derived from the expert count
    return settings


def _bench_targets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The checkout's targets module for `--check-targets` (it registers the peers they compare with), else None."""
    if not args.check_targets:
        return None
    from torch_r3.bench.checkout import TargetsUnavailableError, load_targets

    try:
        return load_targets()
    except TargetsUnavailableError as e:
        parser.error(str(e))


def _bench_strategies(args: argparse.Namespace, parser: argparse.ArgumentParser, targets: Any) -> tuple[list[str], str]:
    """The strategies to time and the one speedups are over: the options', else the targets' or the defaults."""
    from torch_r3 import bench

    known = list(bench.registered())
    strategies = args.strategies or list(targets.STRATEGIES if targets else bench.STRATEGIES)
    unknown = [s for s in strategies if s not in known]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; choose from {', '.join(known)}")
    if args.speedup_over is not None and args.speedup_over not in known:
        parser.error(f"--speedup-over: unknown {args.speedup_over!r}; choose from {', '.join(known)}")
    return strategies, args.speedup_over or (targets.SPEEDUP_OVER if targets else bench.SERIAL)


def _bench_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3 import bench

    settings = _bench_settings(args)
    targets_module = _bench_targets(args, parser)
    strategies, speedup_over = _bench_strategies(args, parser, targets_module)
    if args.sweep and not args.plot:
        parser.error("--sweep only applies with --plot")
    _check_writable(parser, "--json", args.json)
    _check_writable(parser, "--plot", args.plot)
    try:
        config = bench.BenchConfig(**settings)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'torch_r3[bench]'")
    if targets_module is not None:
        if not bench.is_default_shape(config):
            parser.error("--check-targets judges the default shape only; drop the shape options")
        missing = [s for s in targets_module.REQUIRED_STRATEGIES if s not in strategies]
        if missing:
            parser.error(f"--check-targets needs the strategies {missing}")
    dataloader = args.dataloader or args.check_targets  # the targets judge the DataLoader table too
    if args.batch_size is not None and not dataloader:
        parser.error("--batch-size only applies with --dataloader")
    batch_size = args.batch_size or bench.DEFAULT_BATCH_SIZE
    if dataloader and batch_size > config.num_sequences:
        parser.error(f"--batch-size {batch_size} is larger than --num-sequences {config.num_sequences}")
    sweep = (args.sweep or bench.default_sweep(config.num_sequences)) if args.plot else None
    run_plan = bench.plan(
        config,
        strategies=strategies,
        packed_vs_padded=not args.no_packed_compare,
        sweep=sweep,
        speedup_over=speedup_over,
    )
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
    targets = None
    if targets_module is not None:
        targets = targets_module.check_targets(result)
        print("\n" + targets_module.format_targets(targets))
        if result.busy:
            print("torch-r3 bench: targets not judged: the machine was busy; rerun on a quiet machine", file=sys.stderr)
    if args.json:
        _write_json(args.json, result.to_json(targets), "bench")
    if args.plot:
        bench.plot_sweep(result, args.plot)
        print(f"torch-r3 bench: wrote {args.plot}", file=sys.stderr)
    return 1 if targets_module is not None and not targets_module.targets_met(targets) else 0


# --------------------------------------------------------------------------
# doctor: torch_r3.doctor
# --------------------------------------------------------------------------


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


def _doctor_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3.doctor import fatal_problem, format_doctor

    _check_writable(parser, "--json", args.json)
    report = doctor_report()
    print(format_doctor(report))
    if args.json:
        _write_json(args.json, report, "doctor")
    problem = fatal_problem(report)
    if problem:  # the set-up cannot work as it stands: a script checking the exit status must see it
        print(f"torch-r3 doctor: {problem}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------
# demo: torch_r3.demo, one RL step end to end
# --------------------------------------------------------------------------

# What the demo imports beyond the core, and the extra that installs it, per `--trainer`:
# the trainer's framework first, then the client's aiohttp.
_DEMO_NEEDS = {
    "megatron": (("megatron.core", "megatron"), ("aiohttp", "client")),
    "transformers": (("transformers", "transformers"), ("aiohttp", "client")),
}
_DEMO_SIDES = {"megatron": "a Megatron model", "transformers": "a transformers model"}


def _demo_module():
    from torch_r3 import demo

    return demo


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from torch_r3._extras import MissingExtraError

    try:  # the demo module imports the loopback server, hence aiohttp
        _demo_module().build_parser(p)
    except MissingExtraError:
        # Its options are unknown without the module: take `--trainer`, so that `_demo_run` names
        # that trainer's extras, and let `main` pass over the rest (the demo cannot run anyway).
        p.add_argument("--trainer", choices=tuple(_DEMO_NEEDS), default="megatron")
        p.set_defaults(demo_options_unavailable=True)


def _extras_line(trainer: str) -> str:
    return "pip install 'torch_r3[{}]'".format(",".join(extra for _module, extra in _DEMO_NEEDS[trainer]))


def _demo_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3._extras import MissingExtraError, require

    # `--dsa` trains a transformers DeepSeek-V3.2 model whatever `--trainer` says; `--engine vllm`
    # trains the transformers model unless `--trainer` says otherwise (the demo then refuses).
    trainer = getattr(args, "trainer", None) or "megatron"
    if getattr(args, "dsa", False) or (
        getattr(args, "trainer", None) is None and getattr(args, "engine", "") == "vllm"
    ):
        trainer = "transformers"
    needs = _DEMO_NEEDS[trainer]
    try:
        demo = _demo_module()
        # Megatron's import-time fallback notices (no Apex, no Transformer Engine)
        # say nothing to a demo user: the imports run inside the demo's filter too.
        with demo.quiet_third_party_warnings():
            for module, extra in needs:
                require(module, extra)
    except MissingExtraError as e:
        message = f"torch-r3 demo: {e.distribution} is not installed; the demo needs {_extras_line(trainer)}"
        if e.extra == needs[0][1]:  # the trainer's framework is missing: the other side may be there
            (other,) = (t for t in _DEMO_NEEDS if t != trainer)
            message += (
                f", or run it with {_DEMO_SIDES[other]}: torch-r3 demo --trainer {other} (needs {_extras_line(other)})"
            )
        print(message, file=sys.stderr)
        return 2
    with demo.quiet_third_party_warnings():
        return demo.run_from_args(args)


# --------------------------------------------------------------------------
# report: torch_r3.report, an HTML page of a run log's figures
# --------------------------------------------------------------------------


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="RUN.jsonl", help="run logs written by torch_r3.runlog.RunLog")
    p.add_argument("-o", "--output", metavar="PATH", help="the HTML page (default: the first log's name, .html)")
    p.add_argument("--png-dir", metavar="DIR", help="also write each figure there as NAME.png")
    p.add_argument("--title", default="torch_r3 run report", help="the page's title")
    p.add_argument("--json", metavar="PATH", help="also write what was drawn (page, lines, figures) as JSON")


def _report_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch_r3._extras import MissingExtraError
    from torch_r3.runlog import read_run_log

    output = args.output or os.path.splitext(args.logs[0])[0] + ".html"
    _check_writable(parser, "--output", output)
    _check_writable(parser, "--json", args.json)
    records = []
    for path in args.logs:
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
        try:
            records += read_run_log(path)
        except ValueError as e:  # main prints it as one line: say what the command reads
            raise ValueError(
                f"{e}; torch-r3 report reads run logs, one JSON object per line as torch_r3.runlog.RunLog writes them"
            ) from None
    try:
        from torch_r3.report import render_report

        pngs = render_report(records, output, png_dir=args.png_dir, title=args.title)
    except MissingExtraError as e:
        print(f"torch-r3 report: {e}", file=sys.stderr)
        return 2
    print(f"{output}: {len(records)} lines, figures: {', '.join(pngs) or 'none'}")
    print(f"torch-r3 report: wrote {output}", file=sys.stderr)
    if args.json:
        _write_json(args.json, {"output": output, "lines": len(records), "figures": list(pngs)}, "report")
    return 0


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
        "one RL step with R3 end to end: bf16 rollouts, R3Collator, an fp32 Megatron or transformers step",
        _demo_arguments,
        _demo_run,
    ),
    "report": ("an HTML page of a run log's R3 figures (needs matplotlib)", _report_arguments, _report_run),
}


def _parser(wanted: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser; only the `wanted` subcommand gets its options (`demo` imports its module for them)."""
    from torch_r3 import __version__

    parser: argparse.ArgumentParser = _Parser(
        prog="torch-r3",
        description="Routed-expert replay (R3) tools.",
        epilog="Every subcommand prints its report on stdout and status lines on stderr; "
        "--json PATH also writes the full result as JSON to PATH. "
        "'torch-r3 COMMAND --help' lists a subcommand's options.",
    )
    parser.add_argument("--version", action="version", version=f"torch_r3 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers: dict[str, argparse.ArgumentParser] = {}
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
        1 when a check fails, 2 on bad usage, a bad value or a missing extra, 3 when
        `bench` refuses for lack of memory, 130 on Ctrl-C. A bad value found while
        running (`ValueError`, `TypeError`) and Ctrl-C print one line, never a traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser, subparsers = _parser(wanted)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "demo_options_unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # what parse_args says
    if args.command is None:  # the same help, stream and status as --help
        parser.print_help()
        return 0
    _help, _add, run = COMMANDS[args.command]
    ctrl_c = _CtrlC()
    code: int | None = None
    try:
        with ctrl_c:
            code = run(args, subparsers[args.command])
    except KeyboardInterrupt:
        pass
    except (ValueError, TypeError) as e:  # a value the subcommand refused (e.g. demo --server-url notaurl)
        if not ctrl_c.pressed:
            print(f"torch-r3 {args.command}: error: {e}", file=sys.stderr)
            return 2
    if code is None or ctrl_c.pressed:
        print(f"torch-r3 {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
