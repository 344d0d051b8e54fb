"""The collation benchmark behind `torch-r3 bench` (and `benchmarks/collate_bench.py`).

It builds a seeded synthetic batch of per-trajectory route arrays, runs
torch_r3's collation strategies and the floors on that same input in one
process, checks that each output is bit-identical to the first strategy's
before any timing counts, and reports median/min/max wall time, throughput,
speed-up over torch_r3's kernel on one thread, the ratios to a warm `memcpy` of
as many bytes and to the gather floor, and each strategy's peak resident memory.

Other collations can be timed beside them: `register` a `Strategy`, then name
it in `run_shape`'s strategies (or `torch-r3 bench --strategies`). A checkout's
`benchmarks/peers.py` registers the peers' collations this way (a baseline of
what users run without torch_r3, SkyRL-style padded and packed, `pad_sequence`),
and `python -m benchmarks.compare` times them side by side; they are not part
of the installed package.

One module per job:

- `torch_r3.bench.config`: the shape (`BenchConfig`, `PRESETS`) and the synthetic `Batch`;
- `torch_r3.bench.memory`: what a run needs, what the machine has, what a call used;
- `torch_r3.bench.strategies`: the strategies, their registry and the bit-identical checks;
- `torch_r3.bench.runner`: warm-up, interleaved timed rounds, the whole run;
- `torch_r3.bench.dataloader`: the `--dataloader` table (a real `DataLoader` with `R3Collator`);
- `torch_r3.bench.results`: the result dataclasses (the `--json` layout);
- `torch_r3.bench.trust`: whether a run's figures can be trusted (load average, spread of rounds);
- `torch_r3.bench.checkout`: where `--check-targets` finds the targets of a checkout;
- `torch_r3.bench.report` and `torch_r3.bench.units`: the tables and the chart.

The project's own speed targets are not part of the installed package: they
live in `benchmarks/targets.py` of a checkout, which `torch-r3 bench
--check-targets` loads from there (`torch_r3.bench.checkout.load_targets`).

Examples:
    >>> from torch_r3 import bench
    >>> config = bench.BenchConfig(num_sequences=4, max_seqlen=32, num_layers=2, topk=2, repeats=1)
    >>> shape = bench.run_shape(config, [bench.SERIAL, bench.FRESH, bench.PACKED])
    >>> [(s.name, s.checked_against) for s in shape.strategies]
    [('single-write serial', None), ('torch_r3 fresh', 'single-write serial'), ('torch_r3 packed', 'single-write serial')]
    >>> shape.speedup_over, shape.get(bench.SERIAL).speedup
    ('single-write serial', 1.0)
"""

from torch_r3.bench.config import DISTRIBUTIONS, PRESETS, BenchConfig, make_batch
from torch_r3.bench.dataloader import run_dataloader
from torch_r3.bench.memory import InsufficientMemoryError, check_memory, estimate_memory
from torch_r3.bench.report import format_report
from torch_r3.bench.results import BenchResult, DataLoaderResult, DataLoaderRow, ShapeResult, StrategyResult
from torch_r3.bench.runner import run, run_shape
from torch_r3.bench.strategies import FRESH, PACKED, SERIAL, STRATEGIES, Strategy, register, registered, unregister

# isort: split
# The command's own pieces, importable here for `torch-r3 bench` and the tests but not in
# `__all__` (each is documented in its module): re-exports, hence the noqa.
from torch_r3.bench.config import Batch, is_default_shape, sequence_lengths  # noqa: F401
from torch_r3.bench.dataloader import DEFAULT_BATCH_SIZE  # noqa: F401
from torch_r3.bench.memory import available_memory  # noqa: F401
from torch_r3.bench.report import format_table, plot_sweep  # noqa: F401
from torch_r3.bench.runner import Plan, default_sweep, memory_needed, plan  # noqa: F401
from torch_r3.bench.strategies import (  # noqa: F401
    FLOORS,
    GATHER,
    MEMCPY,
    PACKED_GATHER,
    PACKED_STEADY,
    REUSED,
    STEADY,
    Context,
    run_strategy,
)

# What a program that runs the benchmark needs: a shape, the strategies' names and their
# registry, the runs, their results and the memory check.
__all__ = [
    "DISTRIBUTIONS",
    "FRESH",
    "PACKED",
    "PRESETS",
    "SERIAL",
    "STRATEGIES",
    "BenchConfig",
    "BenchResult",
    "DataLoaderResult",
    "DataLoaderRow",
    "InsufficientMemoryError",
    "ShapeResult",
    "Strategy",
    "StrategyResult",
    "check_memory",
    "estimate_memory",
    "format_report",
    "make_batch",
    "register",
    "registered",
    "run",
    "run_dataloader",
    "run_shape",
    "unregister",
]
