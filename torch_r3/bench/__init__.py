"""The collation benchmark behind `torch-r3 bench` (and `benchmarks/collate_bench.py`).

It builds a seeded synthetic batch of per-trajectory route arrays, runs every
collation strategy on that same input in one process, checks that each output
is bit-identical to the first strategy's before any timing counts, and reports
median/min/max wall time, throughput, speed-up over the `baseline`, the ratio
to a warm `memcpy` of as many bytes, and each strategy's peak resident memory.

One module per job:

- `torch_r3.bench.config`: the shape (`BenchConfig`, `PRESETS`) and the synthetic `Batch`;
- `torch_r3.bench.memory`: what a run needs, what the machine has, what a call used;
- `torch_r3.bench.strategies`: the strategies and the bit-identical checks;
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
    >>> shape = bench.run_shape(config, [bench.BASELINE, bench.FRESH])
    >>> [(s.name, s.checked_against) for s in shape.strategies]
    [('baseline', None), ('torch_r3 fresh', 'baseline')]
"""

from torch_r3.bench.config import DISTRIBUTIONS, PRESETS, BenchConfig, make_batch
from torch_r3.bench.dataloader import run_dataloader
from torch_r3.bench.memory import InsufficientMemoryError, check_memory, estimate_memory
from torch_r3.bench.report import format_report
from torch_r3.bench.results import BenchResult, DataLoaderResult, DataLoaderRow, ShapeResult, StrategyResult
from torch_r3.bench.runner import run, run_shape
from torch_r3.bench.strategies import BASELINE, FRESH, STRATEGIES

# isort: split
# The command's own pieces, importable here for `torch-r3 bench` and the tests but not in
# `__all__` (each is documented in its module): re-exports, hence the noqa.
from torch_r3.bench.config import Batch, is_default_shape, sequence_lengths  # noqa: F401
from torch_r3.bench.dataloader import DEFAULT_BATCH_SIZE  # noqa: F401
from torch_r3.bench.memory import available_memory  # noqa: F401
from torch_r3.bench.report import format_table, plot_sweep  # noqa: F401
from torch_r3.bench.runner import Plan, default_sweep, memory_needed, plan  # noqa: F401
from torch_r3.bench.strategies import (  # noqa: F401
    DESCRIPTIONS,
    FLOORS,
    GATHER,
    MEMCPY,
    PACKED,
    PACKED_GATHER,
    PACKED_STEADY,
    PAD_SEQUENCE,
    REUSED,
    SERIAL,
    SKYRL_PACKED,
    SKYRL_PADDED,
    STEADY,
    run_strategy,
)

# What a program that runs the benchmark needs: a shape, the strategies' names, the runs,
# their results and the memory check.
__all__ = [
    "BASELINE",
    "DISTRIBUTIONS",
    "FRESH",
    "PRESETS",
    "STRATEGIES",
    "BenchConfig",
    "BenchResult",
    "DataLoaderResult",
    "DataLoaderRow",
    "InsufficientMemoryError",
    "ShapeResult",
    "StrategyResult",
    "check_memory",
    "estimate_memory",
    "format_report",
    "make_batch",
    "run",
    "run_dataloader",
    "run_shape",
]
