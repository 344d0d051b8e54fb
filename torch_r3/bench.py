"""The collation benchmark behind ``torch-r3 bench`` (and ``benchmarks/collate_bench.py``).

It builds a seeded synthetic batch of per-trajectory route arrays, runs every
collation strategy on that same input in one process, checks that each output
is bit-identical to the first strategy's before any timing counts, and reports
median/min/max wall time, throughput, speed-up over the ``baseline``, the ratio
to a warm ``memcpy`` of as many bytes, and each strategy's peak resident memory.

The strategies (see :data:`STRATEGIES`):

* ``baseline``: what users run today: allocate the full ``[B, T, L, K]`` buffer,
  fill all of it with the padding row (a NumPy broadcast), re-compact every
  sample (:func:`torch_r3.compact_routes`: scan min and max, copy to the
  narrowest dtype), then copy the samples in one by one, on one thread.
* ``single-write serial``: :func:`torch_r3.collate_routes` with ``workers=1``:
  exact-region writes, no prefill, one thread. It isolates what the pool buys.
* ``torch_r3 fresh``: :func:`torch_r3.collate_routes` with its pool and a new
  output per call (the first-touch page faults of a fresh buffer are paid).
* ``torch_r3 reused``: the same into caller-owned ``out=`` buffers (steady state).
* ``torch_r3 packed``: ``layout="packed"`` (THD), a new output per call.
* ``memcpy limit``: a warm copy of as many bytes as the padded output, split over
  as many threads as the pool has: the floor on this machine.
* ``pad_sequence``: ``torch.nn.utils.rnn.pad_sequence(padding_side="left")`` plus
  fixing the padding rows, as a PyTorch user would write it by hand.

Everything here is host-side: outputs are plain (``pin_memory=False``) memory so
that every strategy allocates the same kind of buffer.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_r3.collate import collate_routes, padded_length
from torch_r3.cpu import (
    ENV_NUM_WORKERS,
    affinity_cpus,
    cgroup_cpu_limit,
    cgroup_quotas,
    pool_workers,
    usable_cpus,
)
from torch_r3.routes import canonical_dtype_for, compact_routes

__all__ = [
    "DISTRIBUTIONS",
    "PRESETS",
    "STRATEGIES",
    "BenchConfig",
    "Batch",
    "BenchResult",
    "InsufficientMemoryError",
    "StrategyResult",
    "available_memory",
    "cpu_topology",
    "estimate_memory",
    "format_report",
    "make_batch",
    "memory_needed",
    "plot_sweep",
    "run",
    "run_shape",
    "run_strategy",
    "sequence_lengths",
]

DISTRIBUTIONS = ("uniform", "mild_ragged", "typical_rl", "heavy_tail")

BASELINE = "baseline"
SERIAL = "single-write serial"
FRESH = "torch_r3 fresh"
REUSED = "torch_r3 reused"
PACKED = "torch_r3 packed"
MEMCPY = "memcpy limit"
PAD_SEQUENCE = "pad_sequence"
#: Every strategy, in the order they are run and reported.
STRATEGIES = (BASELINE, SERIAL, FRESH, REUSED, PACKED, MEMCPY, PAD_SEQUENCE)

#: Named shapes for ``--preset``. ``default`` is the headline shape of the docs.
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(num_sequences=256, max_seqlen=8192, num_layers=40, topk=8, dtype="uint8"),
    "production": dict(num_sequences=1024, max_seqlen=32768, num_layers=40, topk=22, dtype="int16"),
}

# (sigma of the log-normal body, target mean as a fraction of max_seqlen,
# fraction of trajectories truncated at max_seqlen). RL batches nearly always
# hold a few rollouts that hit the generation limit, and those set T.
_SHAPES = {
    "mild_ragged": (0.25, 1 / 2, 0.02),
    "typical_rl": (1.0, 1 / 16, 0.02),
    "heavy_tail": (2.0, 1 / 64, 0.01),
}
_DEFAULT_EXPERTS = {"uint8": 128, "int16": 512, "int32": 1 << 16}
_TORCH = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
# Fraction of trajectories that carry a synthetic EOS (rows = tokens - 2).
_EOS_FRACTION = 1 / 16
# Kept free on top of the estimate: interpreter, torch, matplotlib, page tables.
_MEMORY_SLACK = 512 << 20

ROUTES = "rollout_expert_indices"
ROUTER_MASK = "router_padding_mask"
ATTENTION_MASK = "attention_mask"
CU_SEQLENS = "cu_seqlens"


class InsufficientMemoryError(RuntimeError):
    """The run needs more memory than this machine (or its cgroup) has available."""


# --------------------------------------------------------------------------
# Configuration and synthetic input
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark shape and how to time it. Validated on construction."""

    num_sequences: int = 256
    max_seqlen: int = 8192
    num_layers: int = 40
    topk: int = 8
    num_experts: int | None = None  # default: 128 (uint8), 512 (int16), 65536 (int32)
    dtype: str | None = None  # default: the narrowest dtype that holds num_experts - 1
    distribution: str = "uniform"
    mixed_dtypes: bool = False
    seed: int = 0
    repeats: int = 5
    warmup: int = 1
    workers: int | None = None  # default: torch_r3.cpu.pool_workers()

    def __post_init__(self) -> None:
        for name in ("num_sequences", "max_seqlen", "num_layers", "topk", "repeats", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < (0 if name == "seed" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'seed' else 1}, got {v}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (the first call is checked, never timed), got {self.warmup!r}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise ValueError(f"workers must be a positive int, got {self.workers!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if self.dtype is not None and self.dtype not in _TORCH:
            raise ValueError(f"dtype must be one of {tuple(_TORCH)}, got {self.dtype!r}")
        dtype = self.dtype or ("int16" if self.mixed_dtypes else None)
        experts = self.num_experts
        if experts is None:
            experts = _DEFAULT_EXPERTS[dtype or "uint8"]
        elif isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {experts!r}")
        needed = canonical_dtype_for(experts - 1).name
        if dtype is None:
            dtype = needed
        elif _order(needed) > _order(dtype):
            raise ValueError(f"num_experts={experts} needs expert ids up to {experts - 1}, which need {needed}, "
                             f"not {dtype}")
        if self.mixed_dtypes and dtype == "uint8":
            raise ValueError("mixed_dtypes mixes uint8 and int16 senders, so the batch dtype is int16, not uint8")
        if self.topk > experts:
            raise ValueError(f"topk={self.topk} needs at least that many experts (a route is topk distinct "
                             f"experts), got num_experts={experts}")
        object.__setattr__(self, "num_experts", experts)
        object.__setattr__(self, "dtype", dtype)

    @property
    def label(self) -> str:
        mixed = ", mixed uint8/int16" if self.mixed_dtypes else ""
        return (f"{self.num_sequences} seqs x max {self.max_seqlen} tokens, {self.num_layers} layers, "
                f"topk {self.topk}, {self.num_experts} experts, {self.dtype}{mixed}, {self.distribution}")


def _order(dtype: str) -> int:
    return tuple(_TORCH).index(dtype)


def sequence_lengths(distribution: str, num_sequences: int, max_seqlen: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts ``n_i`` in ``[1, max_seqlen]`` drawn from a named distribution.

    ``uniform`` draws uniformly in ``[1, max_seqlen]``. The others are a
    log-normal body plus a few trajectories truncated at ``max_seqlen`` (the
    rollouts that hit the generation limit), scaled so the batch mean is about
    ``max/2`` (``mild_ragged``), ``max/16`` (``typical_rl``, long tail) or
    ``max/64`` (``heavy_tail``).

    Args:
        distribution: one of :data:`DISTRIBUTIONS`.
        num_sequences: how many lengths.
        max_seqlen: the largest length.
        rng: the random generator (seeded by the caller).

    Returns:
        An ``int64`` array of ``num_sequences`` lengths.
    """
    if distribution == "uniform":
        return rng.integers(1, max_seqlen + 1, size=num_sequences, dtype=np.int64)
    if distribution not in _SHAPES:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    sigma, mean_fraction, truncated = _SHAPES[distribution]
    body = np.exp(sigma * rng.standard_normal(num_sequences))
    hit_limit = rng.choice(num_sequences, size=max(1, round(truncated * num_sequences)), replace=False)
    target = mean_fraction * max_seqlen
    scale = target / body.mean()
    lengths = np.ones(num_sequences, dtype=np.int64)
    for _ in range(30):  # clipping and the truncated rollouts move the mean: rescale until it settles
        lengths = np.clip(np.rint(body * scale), 1, max_seqlen).astype(np.int64)
        lengths[hit_limit] = max_seqlen
        mean = lengths.mean()
        if abs(mean - target) <= 0.01 * target or num_sequences == len(hit_limit):
            break
        rest = num_sequences - len(hit_limit)
        want_rest = max(target * num_sequences - max_seqlen * len(hit_limit), rest)
        have_rest = max(lengths.sum() - max_seqlen * len(hit_limit), 1)
        scale *= want_rest / have_rest
    return lengths


@dataclass
class Batch:
    """A synthetic batch: per-trajectory routes and token counts, plus its sizes."""

    routes: list[np.ndarray]
    token_counts: list[int]
    dtype: np.dtype  # the batch (widest) dtype
    T: int  # padded length
    input_bytes: int
    padded_bytes: int  # rollout_expert_indices + router_padding_mask + attention_mask
    packed_bytes: int  # rollout_expert_indices + router_padding_mask + cu_seqlens

    @property
    def num_layers(self) -> int:
        return self.routes[0].shape[1]

    @property
    def topk(self) -> int:
        return self.routes[0].shape[2]


def _route_array(rng: np.random.Generator, rows: int, L: int, K: int, experts: int, dtype: np.dtype) -> np.ndarray:
    # K distinct experts per row, as a real route: a random first expert, then
    # its K-1 successors modulo the expert count.
    ids = rng.integers(0, experts, size=(rows, L, 1), dtype=np.int32) + np.arange(K, dtype=np.int32)
    if experts & (experts - 1) == 0:
        np.bitwise_and(ids, experts - 1, out=ids)
    else:
        np.remainder(ids, experts, out=ids)
    return ids.astype(dtype)


def make_batch(config: BenchConfig) -> Batch:
    """Build the seeded synthetic batch of ``config``.

    Route rows per trajectory are ``tokens - 1`` (the last sampled token is never
    run forward); one trajectory in 16 carries a synthetic EOS (``tokens - 2``).
    With ``mixed_dtypes`` every other trajectory comes from a ``uint8`` sender
    (expert ids < 256), the rest from ``int16`` senders.

    Args:
        config: the shape and seed.

    Returns:
        The :class:`Batch`.
    """
    rng = np.random.default_rng(config.seed)
    counts = sequence_lengths(config.distribution, config.num_sequences, config.max_seqlen, rng)
    rows = counts - 1
    can_eos = np.flatnonzero(counts >= 2)
    if len(can_eos):
        k = min(len(can_eos), max(1, round(_EOS_FRACTION * config.num_sequences)))
        rows[rng.choice(can_eos, size=k, replace=False)] -= 1
    L, K, E = config.num_layers, config.topk, config.num_experts
    dtype = np.dtype(config.dtype)
    routes = []
    for i, r in enumerate(rows):
        if config.mixed_dtypes and i % 2 == 1:
            routes.append(_route_array(rng, int(r), L, K, min(E, 256), np.dtype(np.uint8)))
        else:
            routes.append(_route_array(rng, int(r), L, K, E, dtype))
    T = padded_length(counts.tolist())
    B, N = len(routes), int(counts.sum())
    row_bytes = L * K * dtype.itemsize
    return Batch(
        routes=routes,
        token_counts=[int(n) for n in counts],
        dtype=dtype,
        T=T,
        input_bytes=sum(a.nbytes for a in routes),
        padded_bytes=B * T * (row_bytes + 1 + 8),
        packed_bytes=N * (row_bytes + 1) + 4 * (B + 1),
    )


# --------------------------------------------------------------------------
# Memory: what a run needs, what the machine has, what a strategy used
# --------------------------------------------------------------------------


def estimate_memory(config: BenchConfig) -> int:
    """Bytes a run of ``config`` needs at its peak, from the shape alone (an upper bound).

    Resident together at the peak: the input, the reference output (the first
    strategy's, kept for the bit-identical checks), the ``out=`` buffers of
    ``torch_r3 reused``, the source and destination of ``memcpy limit``, and the
    largest transient: ``pad_sequence``'s copy of the input plus its output.
    """
    L, K = config.num_layers, config.topk
    itemsize = np.dtype(config.dtype).itemsize
    B, T = config.num_sequences, config.max_seqlen
    output = B * T * (L * K * itemsize + 1 + 8)
    # uniform has mean max/2; the others are smaller, but bound by the worst case.
    mean_tokens = T if config.distribution != "uniform" else (T + 1) / 2
    inputs = int(B * mean_tokens * L * K * itemsize)
    return 2 * inputs + 5 * output + _MEMORY_SLACK


def available_memory() -> dict[str, Any]:
    """What this process may still allocate: ``MemAvailable`` and the cgroup memory room.

    Returns:
        ``{"mem_available": bytes | None, "cgroup_room": bytes | None,
        "cgroup": path | None, "available": the smaller of the two known}``.
    """
    mem_available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem_available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    from torch_r3.cpu import cgroup_memory_room

    room, cgroup = cgroup_memory_room()
    known = [v for v in (mem_available, room) if v is not None]
    return {"mem_available": mem_available, "cgroup_room": room, "cgroup": cgroup,
            "available": min(known) if known else None}


def check_memory(config: BenchConfig, probe: Callable[[], dict[str, Any]] | None = None) -> int:
    """Raise :class:`InsufficientMemoryError` unless the run of ``config`` fits; return the need.

    Args:
        config: the run.
        probe: returns :func:`available_memory`'s dict (injectable for tests);
            default :func:`available_memory`.

    Returns:
        The bytes needed (:func:`estimate_memory`).

    Raises:
        InsufficientMemoryError: the run needs more than is available.
    """
    need = estimate_memory(config)
    have = (probe or available_memory)()
    avail = have.get("available")
    if avail is not None and need > avail:
        where = f" (cgroup {have['cgroup']})" if have.get("cgroup") and avail == have.get("cgroup_room") else ""
        raise InsufficientMemoryError(
            f"this run ({config.label}) needs about {_gib(need)} of memory, but only {_gib(avail)} is "
            f"available{where}; use a smaller shape (--num-sequences, --max-seqlen) or a bigger machine"
        )
    return need


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_process_peak = 0


def _note_process_peak() -> int:
    """The process-lifetime peak RSS, carried across ``clear_refs`` resets of ``VmHWM``."""
    global _process_peak
    _process_peak = max(_process_peak, _status_kib("VmHWM:") or 0)
    return _process_peak


class _PeakRss:
    """Peak resident memory above the level at entry, for one strategy call.

    ``ru_maxrss`` and ``VmHWM`` are process-lifetime peaks, so the earlier (and
    larger) strategies would mask the later ones. Linux lets a process reset its
    own ``VmHWM`` by writing ``5`` to ``/proc/self/clear_refs``: that gives an
    exact per-call peak with no perturbation of the call. Where that is not
    allowed, a thread samples ``VmRSS`` every millisecond instead (the outputs
    stay alive until the call returns, so the sampled peak is close).
    """

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _PeakRss:
        self.start = _status_kib("VmRSS:") or 0
        _note_process_peak()  # the reset below would lose the process-lifetime peak
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM (reset via /proc/self/clear_refs)"
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status_kib("VmRSS:") or 0)

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_kib("VmRSS:") or 0)
        else:
            self.peak = _status_kib("VmHWM:") or 0

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.start)


# --------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------


class _Context:
    """Per-batch state shared by the strategies: buffers allocated (and touched) once."""

    def __init__(self, batch: Batch, workers: int, strategies: Sequence[str]):
        self.batch = batch
        self.workers = workers
        self.out: dict[str, torch.Tensor] | None = None
        self.src = self.dst = None
        self.copy_pool: ThreadPoolExecutor | None = None
        if REUSED in strategies:
            # Warm buffers that hold garbage, so that a byte the kernel failed
            # to write shows up in the bit-identical check.
            B, T = len(batch.routes), batch.T
            self.out = {
                ROUTES: torch.full((B, T, batch.num_layers, batch.topk), -1 if batch.dtype.kind == "i" else 255,
                                   dtype=_TORCH[batch.dtype.name]),
                ROUTER_MASK: torch.ones((B, T), dtype=torch.bool),
                ATTENTION_MASK: torch.full((B, T), 7, dtype=torch.long),
            }
        if MEMCPY in strategies:
            self.src = np.ones(batch.padded_bytes, dtype=np.uint8)
            self.dst = np.zeros(batch.padded_bytes, dtype=np.uint8)
            self.copy_pool = ThreadPoolExecutor(max(1, workers - 1), thread_name_prefix="torch_r3-bench-memcpy")

    def close(self) -> None:
        if self.copy_pool is not None:
            self.copy_pool.shutdown()


def _baseline(ctx: _Context) -> dict[str, torch.Tensor]:
    b = ctx.batch
    B, T, L, K = len(b.routes), b.T, b.num_layers, b.topk
    routes = torch.empty((B, T, L, K), dtype=_TORCH[b.dtype.name])
    out = routes.numpy()
    out[...] = np.arange(K, dtype=b.dtype)  # prefill every row with the padding route
    mask = np.ones((B, T), dtype=bool)
    att = np.zeros((B, T), dtype=np.int64)
    for i, (a, n) in enumerate(zip(b.routes, b.token_counts)):
        a = compact_routes(a)  # the receiver distrusts the sender: min/max scan and a copy
        s = T - n
        out[i, s : s + a.shape[0]] = a
        mask[i, s : s + a.shape[0]] = False
        att[i, s:] = 1
    return {ROUTES: routes, ROUTER_MASK: torch.from_numpy(mask), ATTENTION_MASK: torch.from_numpy(att)}


def _serial(ctx: _Context) -> dict[str, torch.Tensor]:
    # The kernel itself on the calling thread: the same writes as torch_r3
    # fresh, so the difference between the two is exactly the pool.
    b = ctx.batch
    return collate_routes(b.routes, b.token_counts, workers=1, pin_memory=False)


def _fresh(ctx: _Context) -> dict[str, torch.Tensor]:
    b = ctx.batch
    return collate_routes(b.routes, b.token_counts, workers=ctx.workers, pin_memory=False)


def _reused(ctx: _Context) -> dict[str, torch.Tensor]:
    b = ctx.batch
    return collate_routes(b.routes, b.token_counts, workers=ctx.workers, out=ctx.out)


def _packed(ctx: _Context) -> dict[str, torch.Tensor]:
    b = ctx.batch
    return collate_routes(b.routes, b.token_counts, layout="packed", workers=ctx.workers, pin_memory=False)


def _memcpy(ctx: _Context) -> None:
    # As many threads as the pool, each copying one contiguous slice.
    n, w = ctx.src.nbytes, ctx.workers
    bounds = [(n * k // w, n * (k + 1) // w) for k in range(w)]
    futures = [ctx.copy_pool.submit(np.copyto, ctx.dst[lo:hi], ctx.src[lo:hi]) for lo, hi in bounds[1:]]
    lo, hi = bounds[0]
    np.copyto(ctx.dst[lo:hi], ctx.src[lo:hi])
    for f in futures:
        f.result()
    return None


def _pad_sequence(ctx: _Context) -> dict[str, torch.Tensor]:
    b = ctx.batch
    T, L, K = b.T, b.num_layers, b.topk
    tdtype = _TORCH[b.dtype.name]
    pad_row = torch.arange(K, dtype=tdtype).expand(L, K)
    seqs = []
    for a, n in zip(b.routes, b.token_counts):
        t = torch.from_numpy(a).to(tdtype)
        if n > t.shape[0]:  # the uncaptured tail gets padding routes
            t = torch.cat([t, pad_row.expand(n - t.shape[0], L, K)])
        seqs.append(t)
    routes = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_side="left")
    counts = torch.tensor(b.token_counts)
    rows = torch.tensor([a.shape[0] for a in b.routes])
    pos = torch.arange(T)
    start = (T - counts)[:, None]
    att = pos >= start
    routes[~att] = pad_row  # pad_sequence left-pads with the scalar 0: fix those rows
    mask = ~(att & (pos < start + rows[:, None]))
    return {ROUTES: routes, ROUTER_MASK: mask, ATTENTION_MASK: att.long()}


_FUNCS: dict[str, Callable[[_Context], Any]] = {
    BASELINE: _baseline,
    SERIAL: _serial,
    FRESH: _fresh,
    REUSED: _reused,
    PACKED: _packed,
    MEMCPY: _memcpy,
    PAD_SEQUENCE: _pad_sequence,
}


def run_strategy(name: str, batch: Batch, workers: int | None = None) -> dict[str, torch.Tensor] | None:
    """Run one strategy once on ``batch`` and return its output (``None`` for ``memcpy limit``).

    Args:
        name: one of :data:`STRATEGIES`.
        batch: from :func:`make_batch`.
        workers: pool workers (default :func:`torch_r3.cpu.pool_workers`).

    Returns:
        The strategy's output dict, as :func:`torch_r3.collate_routes` returns it.
    """
    if name not in _FUNCS:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")
    ctx = _Context(batch, workers or pool_workers(), [name])
    try:
        return _FUNCS[name](ctx)
    finally:
        ctx.close()


def _packed_from_padded(ref: dict[str, torch.Tensor], counts: list[int]) -> dict[str, torch.Tensor]:
    # With arange padding a padding row does not depend on its position, so the
    # packed batch is the padded one with each row's left padding cut off.
    T = ref[ROUTES].shape[1]
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(counts), 0)
    return {
        ROUTES: torch.cat([ref[ROUTES][i, T - n :] for i, n in enumerate(counts)]),
        ROUTER_MASK: torch.cat([ref[ROUTER_MASK][i, T - n :] for i, n in enumerate(counts)]),
        CU_SEQLENS: cu,
    }


def _check_identical(name: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], first: str) -> None:
    for key, w in want.items():
        g = got.get(key)
        if g is None or g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            detail = "missing" if g is None else f"{g.dtype} {list(g.shape)} vs {w.dtype} {list(w.shape)}"
            raise AssertionError(f"strategy {name!r}: {key} is not bit-identical to {first!r}'s ({detail})")


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


@dataclass
class StrategyResult:
    """One strategy's figures on one batch (times in seconds, memory in bytes)."""

    name: str
    times_s: list[float]
    median_s: float
    min_s: float
    max_s: float
    bytes_written: int
    gb_per_s: float
    peak_extra_bytes: int  # resident memory the call added at its peak
    peak_bytes: int  # input + peak_extra_bytes: the call's working set
    peak_ratio: float | None  # peak_bytes / (input + output bytes); None for memcpy limit
    speedup_vs_baseline: float | None = None
    ratio_to_memcpy: float | None = None
    checked_against: str | None = None


@dataclass
class ShapeResult:
    """Every strategy's figures on one batch."""

    config: dict[str, Any]
    label: str
    T: int
    tokens: int
    input_bytes: int
    padded_bytes: int
    packed_bytes: int
    workers: int
    peak_method: str
    strategies: list[StrategyResult]

    def get(self, name: str) -> StrategyResult | None:
        return next((s for s in self.strategies if s.name == name), None)


@dataclass
class BenchResult:
    """A full run: the main shape, the typical_rl packed-vs-padded pair, the sweep."""

    main: ShapeResult
    packed_vs_padded: ShapeResult | None
    sweep: list[ShapeResult]
    topology: dict[str, Any]
    targets: list[dict[str, Any]]
    memory_needed_bytes: int
    wall_s: float
    peak_rss_bytes: int | None
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the ``--json`` schema, ``schema_version`` 1)."""
        return {"schema_version": 1, **dataclasses.asdict(self)}


class Progress:
    """A one-line progress bar on stderr (only on a terminal, unless forced)."""

    def __init__(self, total: int, enabled: bool | None = None, stream: Any = None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 28
        filled = int(width * min(self.done, self.total) / self.total)
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:5.0f}s  {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _steps(config: BenchConfig, strategies: Sequence[str]) -> int:
    return len(strategies) * (config.warmup + config.repeats)


def run_shape(
    config: BenchConfig,
    strategies: Sequence[str] = STRATEGIES,
    progress: Progress | None = None,
) -> ShapeResult:
    """Time ``strategies`` on the batch of ``config``, all in this process.

    Phase 1 (warm-up): each strategy runs ``config.warmup`` times; its first call
    is the checked one (outputs compared with ``torch.equal`` to the first
    strategy's, and its peak memory measured). Phase 2: ``config.repeats``
    rounds, each timing every strategy once, interleaved so that a burst of load
    from elsewhere on the machine hits all strategies alike.

    Args:
        config: the shape.
        strategies: names from :data:`STRATEGIES`, in run order. The first one
            that produces an output is the reference.
        progress: where to report each call.

    Returns:
        The :class:`ShapeResult`.

    Raises:
        AssertionError: a strategy's output differs from the reference.
    """
    unknown = [s for s in strategies if s not in _FUNCS]
    if unknown or not strategies:
        raise ValueError(f"strategies must be a non-empty selection of {STRATEGIES}, got {list(strategies)}")
    workers = config.workers or pool_workers()
    batch = make_batch(config)
    ctx = _Context(batch, workers, strategies)
    times: dict[str, list[float]] = {s: [] for s in strategies}
    extra: dict[str, int] = {}
    checked: dict[str, str | None] = {}
    ref: dict[str, torch.Tensor] | None = None
    ref_name: str | None = None
    packed_ref: dict[str, torch.Tensor] | None = None
    method = ""
    gc_was_enabled = gc.isenabled()
    try:
        for name in strategies:
            fn = _FUNCS[name]
            for w in range(config.warmup):
                if w == 0:
                    with _PeakRss() as peak:
                        out = fn(ctx)
                    extra[name], method = peak.extra, peak.method
                    if out is not None:
                        if name == PACKED:
                            if packed_ref is None and ref is not None:
                                packed_ref = _packed_from_padded(ref, batch.token_counts)
                            if packed_ref is None:
                                packed_ref, checked[name] = out, None
                            else:
                                _check_identical(name, out, packed_ref, ref_name or name)
                                checked[name] = ref_name
                        elif ref is None:
                            ref, ref_name, checked[name] = out, name, None
                            if packed_ref is not None:
                                _check_identical(PACKED, packed_ref, _packed_from_padded(ref, batch.token_counts),
                                                 name)
                                checked[PACKED] = name
                        else:
                            _check_identical(name, out, ref, ref_name)
                            checked[name] = ref_name
                else:
                    out = fn(ctx)
                del out
                if progress:
                    progress.step(f"{name} warm-up")
        del ref, packed_ref
        # Outputs are freed by reference counting; the cyclic collector only
        # adds noise (tens of ms with torch loaded), so it is kept out of the
        # timed calls.
        gc.collect()
        gc.disable()
        for r in range(config.repeats):
            for name in strategies:
                fn = _FUNCS[name]
                t0 = time.perf_counter()
                out = fn(ctx)
                times[name].append(time.perf_counter() - t0)
                del out  # freed outside the timed region
                if progress:
                    progress.step(f"{name} {r + 1}/{config.repeats}")
    finally:
        if gc_was_enabled:
            gc.enable()
        ctx.close()

    results = []
    for name in strategies:
        ts = times[name]
        med = float(np.median(ts))
        written = batch.packed_bytes if name == PACKED else batch.padded_bytes
        out_bytes = written if name != MEMCPY else 0
        peak_bytes = batch.input_bytes + extra[name]
        results.append(StrategyResult(
            name=name, times_s=ts, median_s=med, min_s=min(ts), max_s=max(ts), bytes_written=written,
            gb_per_s=written / med / 1e9, peak_extra_bytes=extra[name], peak_bytes=peak_bytes,
            peak_ratio=peak_bytes / (batch.input_bytes + out_bytes) if out_bytes else None,
            checked_against=checked.get(name),
        ))
    base = next((s for s in results if s.name == BASELINE), None)
    floor = next((s for s in results if s.name == MEMCPY), None)
    for s in results:
        if base is not None:
            s.speedup_vs_baseline = base.median_s / s.median_s
        if floor is not None:
            s.ratio_to_memcpy = s.median_s / floor.median_s
    return ShapeResult(
        config=dataclasses.asdict(config), label=config.label, T=batch.T, tokens=sum(batch.token_counts),
        input_bytes=batch.input_bytes, padded_bytes=batch.padded_bytes, packed_bytes=batch.packed_bytes,
        workers=workers, peak_method=method, strategies=results,
    )


def cpu_topology() -> dict[str, Any]:
    """The CPU topology the pool sees (what ``torch-r3 doctor`` and the report show)."""
    return {
        "affinity_cpus": affinity_cpus(),
        "os_cpu_count": os.cpu_count(),
        "cgroup_quotas": [dataclasses.asdict(q) for q in cgroup_quotas()],
        "cgroup_cpu_limit": cgroup_cpu_limit(),
        "usable_cpus": usable_cpus(),
        "pool_workers": pool_workers(),
        ENV_NUM_WORKERS: os.environ.get(ENV_NUM_WORKERS),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch_num_threads": torch.get_num_threads(),
        # Other work on the machine shows up here: a pool cannot speed up on
        # CPUs that someone else is using, and OpenMP code degrades sharply.
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _is_headline(config: dict[str, Any]) -> bool:
    want = dict(PRESETS["default"], distribution="uniform", mixed_dtypes=False, num_experts=128)
    return all(config[k] == v for k, v in want.items())


def _targets(main: ShapeResult, pair: ShapeResult | None) -> list[dict[str, Any]]:
    """The speed targets of the issue (defined for the default shape on 2-core machines).

    Every entry carries ``applies``: whether the run's shape is the one the target is set for.
    """
    out = []
    applies = _is_headline(main.config)

    def add(name: str, value: float | None, op: str, threshold: float, what: str) -> None:
        if value is None:
            return
        met = value >= threshold if op == ">=" else value <= threshold
        out.append({"name": name, "value": value, "op": op, "threshold": threshold, "met": met, "what": what,
                    "applies": applies})

    s = {r.name: r for r in main.strategies}
    if FRESH in s and BASELINE in s:
        add("fresh_vs_baseline", s[BASELINE].median_s / s[FRESH].median_s, ">=", 7.0,
            "torch_r3 fresh speed-up over baseline")
    if FRESH in s and SERIAL in s:
        add("fresh_vs_serial", s[SERIAL].median_s / s[FRESH].median_s, ">=", 1.3,
            "torch_r3 fresh speed-up over single-write serial")
    if REUSED in s and MEMCPY in s:
        add("reused_vs_memcpy", s[REUSED].median_s / s[MEMCPY].median_s, "<=", 1.25,
            "torch_r3 reused time / memcpy limit time")
    if FRESH in s:
        add("fresh_peak_memory", s[FRESH].peak_ratio, "<=", 1.1, "torch_r3 fresh peak memory / (input + output)")
    if pair is not None:
        p = {r.name: r for r in pair.strategies}
        if FRESH in p and PACKED in p:
            add("packed_vs_padded_typical_rl", p[FRESH].median_s / p[PACKED].median_s, ">=", 8.0,
                "typical_rl: torch_r3 packed speed-up over torch_r3 fresh padded")
    return out


def default_sweep(num_sequences: int) -> list[int]:
    """The ``num_sequences`` points of the ``--plot`` sweep: n/8, n/4, n/2, n."""
    return sorted({max(1, num_sequences // d) for d in (8, 4, 2, 1)})


def _plan(config, strategies, packed_vs_padded, sweep):
    pair_config = None
    if packed_vs_padded and not (config.distribution == "typical_rl" and FRESH in strategies and PACKED in strategies):
        pair_config = dataclasses.replace(config, distribution="typical_rl")
    sweep_configs = [dataclasses.replace(config, num_sequences=n) for n in (sweep or ()) if n != config.num_sequences]
    return pair_config, sweep_configs


def memory_needed(
    config: BenchConfig,
    *,
    strategies: Sequence[str] = STRATEGIES,
    packed_vs_padded: bool = True,
    sweep: Sequence[int] | None = None,
) -> int:
    """Bytes the :func:`run` of these arguments needs: its largest shape's :func:`estimate_memory`."""
    pair_config, sweep_configs = _plan(config, strategies, packed_vs_padded, sweep)
    return max(estimate_memory(c) for c in [config, *([pair_config] if pair_config else []), *sweep_configs])


def run(
    config: BenchConfig,
    *,
    strategies: Sequence[str] = STRATEGIES,
    packed_vs_padded: bool = True,
    sweep: Sequence[int] | None = None,
    progress: bool | None = None,
    memory_probe: Callable[[], dict[str, Any]] | None = None,
) -> BenchResult:
    """The whole benchmark: the main shape, the ``typical_rl`` packed-vs-padded pair, an optional sweep.

    Args:
        config: the main shape.
        strategies: which strategies to time on it.
        packed_vs_padded: also time ``torch_r3 fresh`` against ``torch_r3 packed``
            on a ``typical_rl`` batch of the same size.
        sweep: ``num_sequences`` values to repeat the main run at (for the chart).
        progress: show a progress bar (default: when stderr is a terminal).
        memory_probe: returns :func:`available_memory`'s dict; injectable for tests
            (default :func:`available_memory`).

    Returns:
        The :class:`BenchResult`.

    Raises:
        InsufficientMemoryError: the largest shape does not fit the memory available.
    """
    t0 = time.perf_counter()
    topology = cpu_topology()  # before the run, so that the load average is other work's
    pair_config, sweep_configs = _plan(config, strategies, packed_vs_padded, sweep)
    need = max(check_memory(c, memory_probe) for c in [config, *([pair_config] if pair_config else []),
                                                         *sweep_configs])
    pair_strats = (FRESH, PACKED)
    total = _steps(config, strategies) + (_steps(config, pair_strats) if pair_config else 0)
    total += sum(_steps(c, strategies) for c in sweep_configs)
    bar = Progress(total, progress)
    try:
        main = run_shape(config, strategies, bar)
        pair = run_shape(pair_config, pair_strats, bar) if pair_config else (main if packed_vs_padded else None)
        swept = [run_shape(c, strategies, bar) for c in sweep_configs]
    finally:
        bar.close()
    points = sorted(swept + [main], key=lambda r: r.config["num_sequences"]) if sweep else []
    return BenchResult(
        main=main, packed_vs_padded=pair, sweep=points, topology=topology, targets=_targets(main, pair),
        memory_needed_bytes=need, wall_s=time.perf_counter() - t0, peak_rss_bytes=_note_process_peak(),
        versions={"torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]},
    )


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}x"


def format_table(shape: ShapeResult) -> str:
    """The strategies of one batch as an aligned text table."""
    head = ("strategy", "median ms", "min ms", "max ms", "GB/s", "vs baseline", "vs memcpy", "peak MB",
            "peak/(in+out)", "checked")
    rows = [head]
    for s in shape.strategies:
        check = "reference" if s.name != MEMCPY and s.checked_against is None else (
            "-" if s.name == MEMCPY else "identical")
        rows.append((s.name, f"{s.median_s * 1e3:,.1f}", f"{s.min_s * 1e3:,.1f}", f"{s.max_s * 1e3:,.1f}",
                     f"{s.gb_per_s:.2f}", _x(s.speedup_vs_baseline), _x(s.ratio_to_memcpy),
                     _mb(s.peak_bytes), _x(s.peak_ratio), check))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(shape: ShapeResult) -> str:
    return (f"{shape.label}: T={shape.T}, {shape.tokens:,} tokens; input {_mb(shape.input_bytes)} MB, "
            f"padded output {_mb(shape.padded_bytes)} MB, packed output {_mb(shape.packed_bytes)} MB; "
            f"{shape.workers} pool workers")


def format_report(result: BenchResult) -> str:
    """The terminal report of a run."""
    t = result.topology
    c = result.main.config
    lines = [
        f"torch-r3 bench  ({c['repeats']} repeats after {c['warmup']} warm-up, medians; seed {c['seed']})",
        f"CPU: usable {t['usable_cpus']:g} (affinity {t['affinity_cpus']}, cgroup limit "
        f"{t['cgroup_cpu_limit'] if t['cgroup_cpu_limit'] is not None else 'none'}), pool workers "
        f"{t['pool_workers']}, torch threads {t['torch_num_threads']}, "
        f"OMP_NUM_THREADS={t['OMP_NUM_THREADS'] or 'unset'}, load average "
        f"{'?' if t['loadavg_1min'] is None else format(t['loadavg_1min'], '.2f')}",
        "",
        _describe(result.main),
        format_table(result.main),
        "",
        f"peak = input + resident memory the call added ({result.main.peak_method})",
    ]
    pair = result.packed_vs_padded
    if pair is not None and pair is not result.main:
        lines += ["", "packed vs padded on typical_rl:", _describe(pair), format_table(pair)]
    if result.targets and not result.targets[0]["applies"]:
        lines += ["", "(the speed targets are set for the default shape only; not judged on this one)"]
    elif result.targets:
        lines += ["", "targets (set for the default shape on 2-core machines):"]
        for g in result.targets:
            lines.append(f"  [{'met' if g['met'] else 'MISSED'}] {g['what']}: {g['value']:.2f} "
                         f"(target {g['op']} {g['threshold']:g})")
    lines += ["", f"wall {result.wall_s:.1f} s, process peak RSS "
              f"{_gib(result.peak_rss_bytes) if result.peak_rss_bytes else '?'}, estimated need "
              f"{_gib(result.memory_needed_bytes)}"]
    return "\n".join(lines)


def plot_sweep(result: BenchResult, path: str | os.PathLike) -> None:
    """Write a PNG chart: median time per strategy across the ``num_sequences`` sweep.

    Args:
        result: a run with a sweep (falls back to the main shape alone).
        path: the PNG to write.
    """
    import matplotlib  # lazy: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result.sweep or [result.main]
    xs = [p.config["num_sequences"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name in [s.name for s in points[0].strategies]:
        ys = [p.get(name).median_s * 1e3 for p in points]
        lo = [y - p.get(name).min_s * 1e3 for y, p in zip(ys, points)]
        hi = [p.get(name).max_s * 1e3 - y for y, p in zip(ys, points)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("num_sequences")
    ax.set_ylabel("time per batch, ms (median, bars: min-max)")
    c = result.main.config
    ax.set_title(f"route collation: max {c['max_seqlen']} tokens, {c['num_layers']} layers, topk {c['topk']}, "
                 f"{c['dtype']}, {c['distribution']}\n{result.topology['usable_cpus']:g} usable CPUs, "
                 f"{result.main.workers} pool workers", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
