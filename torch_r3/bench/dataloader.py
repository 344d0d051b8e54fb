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
two floors, both on as many threads as the collator's pool:

- the memcpy floor: one contiguous copy of as many bytes as each batch's
  output, from the same warm source into the same warm destination every
  batch. On a machine with a large last-level cache both stay in it, so this
  is a cache-warm copy, not a copy of the batch's own bytes;
- the gather floor (`GatherFloor`): each batch's own source arrays, in their
  own memory as the `DataLoader` hands them to the collator, copied into one
  warm destination of the batch's output size laid out as the collator lays
  it out (padding rows from a small hot template, both masks, `input_ids`).
  It is the least a collator can cost for these bytes from where they live;
  what a configuration takes beyond it is the collator's and the `DataLoader`'s
  own work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from torch_r3 import R3Collator
from torch_r3._checks import check_int
from torch_r3.bench.config import Batch, BenchConfig, make_batch
from torch_r3.bench.memory import collector_paused
from torch_r3.bench.reference import check_identical
from torch_r3.bench.results import DataLoaderResult, DataLoaderRow
from torch_r3.bench.strategies import parallel_copy
from torch_r3.collate._memory import accelerator_available
from torch_r3.collate.collator import collate_routes, padded_length
from torch_r3.collate.layout import Memory
from torch_r3.cpu import pool_workers
from torch_r3.keys import ATTENTION_MASK, INPUT_IDS, ROUTER_MASK, ROUTES, SAMPLE_ROUTES

__all__ = [
    "COLLATORS",
    "DEFAULT_BATCH_SIZE",
    "LOADER_WORKERS",
    "GatherFloor",
    "RouteSamples",
    "configurations",
    "run_dataloader",
]

#: Trajectories per DataLoader batch unless `--batch-size` says otherwise.
DEFAULT_BATCH_SIZE = 32
#: The `num_workers` values timed.
LOADER_WORKERS = (0, 2)
#: The collators timed: `fresh` (`cache_bytes=0`) and `recycled` (the default).
COLLATORS = ("fresh", "recycled")
# Timed epochs per configuration (after one checked warm-up epoch).
_EPOCHS = 3
# Bytes of the gather floor's padding template: a few padding rows that stay in
# the core's own caches, copied as many times as a padding region needs (as
# the collator's template is).
_TEMPLATE_BYTES = 64 << 10


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


def _batch_layout(counts: list[int], batch_size: int, row_bytes: int) -> tuple[list[int], list[int]]:
    """Each DataLoader batch's padded length `T` and output bytes (routes, router mask, attention mask, ids).

    Args:
        counts: token counts of the trajectories, in dataset order.
        batch_size: trajectories per batch (the last batch may be short).
        row_bytes: route bytes per token, `L * K * itemsize`.
    """
    chunks = [counts[lo : lo + batch_size] for lo in range(0, len(counts), batch_size)]
    lengths = [padded_length(c) for c in chunks]
    return lengths, [len(c) * T * (row_bytes + 1 + 8 + 8) for c, T in zip(chunks, lengths)]


def _time_floor(copy_batch: Any, num_batches: int, epochs: int) -> tuple[float, float]:
    """Median per-batch time of `copy_batch(k)` over `epochs` passes, and the sum of the medians.

    A first, untimed pass warms the pages and the threads.
    """
    per_batch: list[list[float]] = [[] for _ in range(num_batches)]
    for epoch in range(epochs + 1):
        for k in range(num_batches):
            t0 = time.perf_counter()
            copy_batch(k)
            if epoch:
                per_batch[k].append(time.perf_counter() - t0)
    medians = [float(np.median(t)) for t in per_batch]
    return float(np.median(medians)), float(sum(medians))


def _floor(sizes: list[int], workers: int, epochs: int) -> tuple[float, float]:
    """Median per-batch and per-epoch time of the memcpy floor: a cache-warm threaded copy of each batch's bytes.

    The source and the destination are the same two buffers every batch, so
    where the last-level cache holds them the copy never reaches memory.
    """
    src = np.ones(max(sizes), dtype=np.uint8)
    dst = np.zeros(max(sizes), dtype=np.uint8)
    with ThreadPoolExecutor(max(1, workers - 1), thread_name_prefix="torch_r3-bench-floor") as pool:
        return _time_floor(
            lambda k: parallel_copy(dst[: sizes[k]], src[: sizes[k]], workers, pool if workers > 1 else None),
            len(sizes),
            epochs,
        )


class GatherFloor:
    """The gather floor: each DataLoader batch's own source arrays copied into one warm buffer.

    Batch `k` holds samples `k * batch_size` on, as a `DataLoader` without a
    sampler gives them. `copy(k)` writes that batch's padded layout (the four
    outputs of `R3Collator`: `rollout_expert_indices [B, T, L, K]`,
    `router_padding_mask`, `attention_mask` and `input_ids [B, T]`,
    `pad_token_id=0`) into a prefix of one destination buffer, the same for
    every batch and warm after the first, reading the trajectories' route and
    token arrays in their own memory, as the collator does. Padding rows come
    from a small template, and the trajectories are split into `workers`
    contiguous groups of equal output, one per thread, the calling thread
    included. It allocates nothing, validates nothing and builds no tensors:
    the least a collator can cost for these bytes from where they live.

    Args:
        dataset: the samples the `DataLoader` reads.
        batch_size: trajectories per batch.
        dtype: the output route dtype (the batch's widest).
        workers: threads in all, as many as the collator's pool.

    Examples:
        >>> from torch_r3.bench import BenchConfig, make_batch
        >>> batch = make_batch(BenchConfig(num_sequences=4, max_seqlen=16, num_layers=2, topk=2))
        >>> with GatherFloor(RouteSamples(batch), 2, batch.dtype, workers=2) as floor:
        ...     out = floor.copy(0)
        ...     {key: tuple(v.shape) for key, v in out.items()} == {
        ...         "rollout_expert_indices": (2, batch.T, 2, 2), "router_padding_mask": (2, batch.T),
        ...         "attention_mask": (2, batch.T), "input_ids": (2, batch.T)}
        True
    """

    def __init__(self, dataset: RouteSamples, batch_size: int, dtype: np.dtype, workers: int):
        self.routes, self.tokens = dataset.routes, dataset.tokens
        self.batch_size, self.workers = batch_size, max(1, workers)
        self.dtype = np.dtype(dtype)
        _, self.L, self.K = self.routes[0].shape
        row = self.L * self.K * self.dtype.itemsize
        self.template = np.ascontiguousarray(
            np.broadcast_to(np.arange(self.K, dtype=self.dtype), (max(1, _TEMPLATE_BYTES // row), self.L, self.K))
        )
        self.T, self.sizes = _batch_layout([t.shape[0] for t in self.tokens], batch_size, row)
        self.buffer = np.zeros(max(self.sizes), dtype=np.uint8)  # mapped, and made warm by the first copies
        self.pool = (
            ThreadPoolExecutor(self.workers - 1, thread_name_prefix="torch_r3-bench-gather")
            if self.workers > 1
            else None
        )

    def __enter__(self) -> GatherFloor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Shut the copy threads down."""
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def views(self, k: int) -> dict[str, np.ndarray]:
        """Batch `k`'s four outputs, carved from the front of the buffer (the 8-byte ones first, aligned)."""
        lo = k * self.batch_size
        B, T = len(self.routes[lo : lo + self.batch_size]), self.T[k]
        bt = B * T
        buf = self.buffer
        return {
            ROUTES: buf[16 * bt : 16 * bt + bt * self.L * self.K * self.dtype.itemsize]
            .view(self.dtype)
            .reshape(B, T, self.L, self.K),
            ROUTER_MASK: buf[self.sizes[k] - bt : self.sizes[k]].view(np.bool_).reshape(B, T),
            ATTENTION_MASK: buf[8 * bt : 16 * bt].view(np.int64).reshape(B, T),
            INPUT_IDS: buf[: 8 * bt].view(np.int64).reshape(B, T),
        }

    def _pad(self, dst: np.ndarray) -> None:
        step = self.template.shape[0]
        for lo in range(0, dst.shape[0], step):
            part = dst[lo : lo + step]
            np.copyto(part, self.template[: part.shape[0]])

    def _write(self, out: dict[str, np.ndarray], first: int, lo: int, hi: int, T: int) -> None:
        routes, mask, att, ids = out[ROUTES], out[ROUTER_MASK], out[ATTENTION_MASK], out[INPUT_IDS]
        for i in range(lo, hi):
            src, tokens = self.routes[first + i], self.tokens[first + i]
            s = T - tokens.shape[0]  # first real token
            e = s + src.shape[0]  # end of the captured rows
            self._pad(routes[i, :s])
            np.copyto(routes[i, s:e], src, casting="safe")
            self._pad(routes[i, e:])
            mask[i, :s], mask[i, s:e], mask[i, e:] = True, False, True
            att[i, :s], att[i, s:] = 0, 1
            ids[i, :s] = 0
            ids[i, s:] = tokens

    def copy(self, k: int) -> dict[str, np.ndarray]:
        """Write batch `k` into the buffer and return its outputs (views that the next copy overwrites).

        Args:
            k: the batch, `0 <= k < len(self.sizes)`.

        Returns:
            `rollout_expert_indices`, `router_padding_mask`, `attention_mask`
            and `input_ids` as NumPy views of the buffer.
        """
        out, first, T = self.views(k), k * self.batch_size, self.T[k]
        B = out[ROUTES].shape[0]
        bounds = [(B * w // self.workers, B * (w + 1) // self.workers) for w in range(self.workers)]
        futures = [self.pool.submit(self._write, out, first, lo, hi, T) for lo, hi in bounds[1:]] if self.pool else []
        lo, hi = bounds[0] if self.pool else (0, B)
        self._write(out, first, lo, hi, T)
        for f in futures:
            f.result()
        return out


def _check_epoch(loader: DataLoader, batch: Batch, batch_size: int, name: str) -> None:
    """The warm-up epoch: every batch must equal `collate_routes` on the same samples."""
    for k, got in enumerate(loader):
        lo = k * batch_size
        want = collate_routes(
            batch.routes[lo : lo + batch_size],
            batch.token_counts[lo : lo + batch_size],
            memory=Memory(pin_memory=False),
        )
        check_identical(name, got, want, "collate_routes")


def _time_epochs(loader: DataLoader, epochs: int) -> tuple[list[float], list[float]]:
    per_batch: list[float] = []
    per_epoch: list[float] = []
    with collector_paused():  # as in the main run
        for _ in range(epochs):
            start = last = time.perf_counter()
            for batch in loader:  # noqa: B007 - `batch` is bound so the last one can be deleted below
                now = time.perf_counter()
                per_batch.append(now - last)
                last = now
            per_epoch.append(last - start)
            del batch  # the last batch goes before the next epoch starts
    return per_batch, per_epoch


def _row(
    dataset: RouteSamples,
    batch: Batch,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
    collator: str,
    epochs: int,
    workers: int | None,
) -> DataLoaderRow:
    row = DataLoaderRow(num_workers=num_workers, pin_memory=pin_memory, collator=collator)
    if pin_memory and not accelerator_available():
        row.skipped = "no accelerator, pin_memory does nothing"
        return row
    collate_fn = R3Collator(
        memory=Memory(workers=workers, cache_bytes=0 if collator == "fresh" else None),
        pad_token_id=0,
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
    name = f"DataLoader(num_workers={num_workers}, pin_memory={pin_memory}) {collator}"
    _check_epoch(loader, batch, batch_size, name)
    row.batch_times_s, row.epoch_times_s = _time_epochs(loader, epochs)
    del loader  # shuts persistent workers down
    row.batch_s = float(np.median(row.batch_times_s))
    row.batch_min_s, row.batch_max_s = min(row.batch_times_s), max(row.batch_times_s)
    row.epoch_s = float(np.median(row.epoch_times_s))
    return row


def run_dataloader(
    config: BenchConfig, batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None, epochs: int = _EPOCHS
) -> DataLoaderResult:
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
    batch_size = check_int(batch_size, "batch_size")
    if not 1 <= batch_size <= config.num_sequences:
        raise ValueError(f"batch_size must be an int in [1, num_sequences={config.num_sequences}], got {batch_size!r}")
    batch = make_batch(config)
    dataset = RouteSamples(batch, config.seed)
    _, sizes = _batch_layout(list(batch.token_counts), batch_size, batch.num_layers * batch.topk * batch.dtype.itemsize)
    workers = config.workers or pool_workers()
    floor_batch, floor_epoch = _floor(sizes, workers, epochs)
    with GatherFloor(dataset, batch_size, batch.dtype, workers) as gather:
        gather_batch, gather_epoch = _time_floor(gather.copy, len(sizes), epochs)
    rows = []
    for num_workers, pin_memory, collator in configurations():
        row = _row(dataset, batch, batch_size, num_workers, pin_memory, collator, epochs, config.workers)
        if row.batch_s is not None:
            row.ratio_to_floor = row.batch_s / floor_batch
            row.ratio_to_gather_floor = row.batch_s / gather_batch
        rows.append(row)
        if progress:
            progress.step(f"DataLoader {num_workers} workers {collator}")
    return DataLoaderResult(
        batch_size=batch_size,
        num_batches=len(sizes),
        batch_bytes=int(np.mean(sizes)),
        floor_batch_s=floor_batch,
        floor_epoch_s=floor_epoch,
        epochs=epochs,
        rows=rows,
        gather_floor_batch_s=gather_batch,
        gather_floor_epoch_s=gather_epoch,
    )
