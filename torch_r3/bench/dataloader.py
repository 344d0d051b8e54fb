"""The `--dataloader` table: batches as a real `torch.utils.data.DataLoader` delivers them.

The synthetic batch's trajectories become a map-style dataset of samples
(`{"routes": [r_i, L, K], "input_ids": [n_i]}`), and an `R3Collator` collates
them `batch_size` at a time, for every combination of `num_workers` (0 and 2),
`pin_memory` (off and on) and collator (`fresh`: `cache_bytes=0`, a new output
every batch; `recycled`: the default, outputs from the collator's buffer pool).
Each configuration runs one warm-up epoch, in which every batch is checked
bit-identical to `torch_r3.collate_routes` on the same samples, then timed
epochs: the wait for each batch as `for batch in loader` sees it (the loop
variable holding the previous batch), and each epoch's wall time. Beside them,
the floor: a warm copy of each batch's output bytes on as many threads as the
collator's pool.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from torch_r3 import R3Collator, accelerator_available
from torch_r3.bench.config import Batch, BenchConfig, make_batch
from torch_r3.bench.results import DataLoaderResult, DataLoaderRow
from torch_r3.bench.strategies import check_identical, parallel_copy
from torch_r3.collate import collate_routes, padded_length
from torch_r3.cpu import pool_workers
from torch_r3.keys import INPUT_IDS, SAMPLE_ROUTES

__all__ = ["COLLATORS", "DEFAULT_BATCH_SIZE", "LOADER_WORKERS", "RouteSamples", "configurations", "run_dataloader"]

#: Trajectories per DataLoader batch unless `--batch-size` says otherwise.
DEFAULT_BATCH_SIZE = 32
#: The `num_workers` values timed.
LOADER_WORKERS = (0, 2)
#: The collators timed: `fresh` (`cache_bytes=0`) and `recycled` (the default).
COLLATORS = ("fresh", "recycled")
# Timed epochs per configuration (after one checked warm-up epoch).
_EPOCHS = 3


class RouteSamples(Dataset):
    """The synthetic batch's trajectories as a map-style dataset of R3 samples.

    Args:
        batch: from `torch_r3.bench.make_batch`; its arrays are shared, not copied.
        seed: for the token ids.
    """

    def __init__(self, batch: Batch, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.routes = batch.routes
        self.tokens = [rng.integers(0, 32000, size=n, dtype=np.int64) for n in batch.token_counts]

    def __len__(self) -> int:
        return len(self.routes)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {SAMPLE_ROUTES: self.routes[i], INPUT_IDS: self.tokens[i]}


def configurations() -> Iterator[tuple[int, bool, str]]:
    """Every `(num_workers, pin_memory, collator)` the table holds, in its order."""
    for num_workers in LOADER_WORKERS:
        for pin_memory in (False, True):
            for collator in COLLATORS:
                yield num_workers, pin_memory, collator


def _batch_bytes(batch: Batch, batch_size: int) -> list[int]:
    """Output bytes of each DataLoader batch: routes, router mask, attention mask, input ids."""
    row = batch.num_layers * batch.topk * batch.dtype.itemsize + 1 + 8 + 8
    counts = batch.token_counts
    chunks = [counts[i : i + batch_size] for i in range(0, len(counts), batch_size)]
    return [len(c) * padded_length(c) * row for c in chunks]


def _floor(sizes: list[int], workers: int, epochs: int) -> tuple[float, float]:
    """Median per-batch and per-epoch time of a warm threaded copy of each batch's bytes."""
    src = np.ones(max(sizes), dtype=np.uint8)
    dst = np.zeros(max(sizes), dtype=np.uint8)
    per_batch: list[list[float]] = [[] for _ in sizes]
    with ThreadPoolExecutor(max(1, workers - 1), thread_name_prefix="torch_r3-bench-floor") as pool:
        for epoch in range(epochs + 1):
            for i, n in enumerate(sizes):
                t0 = time.perf_counter()
                parallel_copy(dst[:n], src[:n], workers, pool if workers > 1 else None)
                if epoch:  # the first pass warms the pages and the threads
                    per_batch[i].append(time.perf_counter() - t0)
    medians = [float(np.median(t)) for t in per_batch]
    return float(np.median(medians)), float(sum(medians))


def _check_epoch(loader: DataLoader, batch: Batch, batch_size: int, name: str) -> None:
    """The warm-up epoch: every batch must equal `collate_routes` on the same samples."""
    for k, got in enumerate(loader):
        lo = k * batch_size
        want = collate_routes(batch.routes[lo : lo + batch_size], batch.token_counts[lo : lo + batch_size],
                              pin_memory=False)
        check_identical(name, got, want, "collate_routes")


def _time_epochs(loader: DataLoader, epochs: int) -> tuple[list[float], list[float]]:
    per_batch: list[float] = []
    per_epoch: list[float] = []
    # As in the main run, the cyclic collector is kept out of the timed loop.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(epochs):
            start = last = time.perf_counter()
            for batch in loader:  # noqa: B007 - `batch` holds the previous batch, as in training
                now = time.perf_counter()
                per_batch.append(now - last)
                last = now
            per_epoch.append(last - start)
            del batch  # the last batch goes before the next epoch starts
    finally:
        if was_enabled:
            gc.enable()
    return per_batch, per_epoch


def _row(dataset: RouteSamples, batch: Batch, batch_size: int, num_workers: int, pin_memory: bool,
         collator: str, epochs: int, workers: int | None) -> DataLoaderRow:
    row = DataLoaderRow(num_workers=num_workers, pin_memory=pin_memory, collator=collator)
    if pin_memory and not accelerator_available():
        row.skipped = "no accelerator, pin_memory does nothing"
        return row
    collate_fn = R3Collator(cache_bytes=0 if collator == "fresh" else None, workers=workers)
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                        pin_memory=pin_memory, persistent_workers=num_workers > 0)
    name = f"DataLoader(num_workers={num_workers}, pin_memory={pin_memory}) {collator}"
    _check_epoch(loader, batch, batch_size, name)
    row.batch_times_s, row.epoch_times_s = _time_epochs(loader, epochs)
    del loader  # shuts persistent workers down
    row.batch_s = float(np.median(row.batch_times_s))
    row.batch_min_s, row.batch_max_s = min(row.batch_times_s), max(row.batch_times_s)
    row.epoch_s = float(np.median(row.epoch_times_s))
    return row


def run_dataloader(config: BenchConfig, batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None,
                   epochs: int = _EPOCHS) -> DataLoaderResult:
    """Time every DataLoader configuration on the trajectories of `config`'s batch.

    Args:
        config: the shape; its `num_sequences` trajectories form one epoch.
        batch_size: trajectories per DataLoader batch.
        progress: a `torch_r3.bench.runner.Progress` to report each configuration to.
        epochs: timed epochs per configuration.

    Returns:
        The `DataLoaderResult`, one row per configuration.

    Raises:
        ValueError: `batch_size` is not between 1 and `config.num_sequences`.
        AssertionError: a DataLoader batch differs from `collate_routes`'s.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= config.num_sequences:
        raise ValueError(f"batch_size must be an int in [1, num_sequences={config.num_sequences}], "
                         f"got {batch_size!r}")
    batch = make_batch(config)
    dataset = RouteSamples(batch, config.seed)
    sizes = _batch_bytes(batch, batch_size)
    floor_batch, floor_epoch = _floor(sizes, config.workers or pool_workers(), epochs)
    rows = []
    for num_workers, pin_memory, collator in configurations():
        row = _row(dataset, batch, batch_size, num_workers, pin_memory, collator, epochs, config.workers)
        if row.batch_s is not None:
            row.ratio_to_floor = row.batch_s / floor_batch
        rows.append(row)
        if progress:
            progress.step(f"DataLoader {num_workers} workers {collator}")
    return DataLoaderResult(batch_size=batch_size, num_batches=len(sizes), batch_bytes=int(np.mean(sizes)),
                            floor_batch_s=floor_batch, floor_epoch_s=floor_epoch, epochs=epochs, rows=rows)
