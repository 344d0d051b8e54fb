"""The collation strategies `torch-r3 bench` times and the floors it judges them by.

torch_r3's own strategies:

- `single-write serial`: `torch_r3.collate_routes` with `workers=1`:
  exact-region writes, no prefill, one thread. It isolates what the pool buys,
  and it is what the report's speed-up column compares with by default.
- `torch_r3 fresh`: `torch_r3.collate_routes` with its pool and a new output per
  call (the first-touch page faults of a fresh buffer are paid every time).
- `torch_r3 reused`: the same into caller-owned `out=` buffers.
- `torch_r3 steady`: `torch_r3.collate_routes` with a `torch_r3.BufferPool`,
  called as a training loop calls its collator: the previous batch is still
  held while the next is made, and released when the next replaces it. This is
  what `R3Collator` does by default, and the figure a training loop sees.
- `torch_r3 packed`: `layout="packed"` (THD), a new output per call.
- `torch_r3 packed steady`: `layout="packed"` with a `torch_r3.BufferPool`,
  called as `torch_r3 steady` is.

The floors (what a collation cannot beat on this machine):

- `gather floor`: exactly the batch's own source arrays, read where they live,
  copied into a warm padded output (padding rows from a small template, both
  masks), trajectories split over as many threads as the pool has; no
  allocation, no checks: the least a padded collation can cost here.
- `packed gather floor`: the same for the packed layout.
- `memcpy limit`: a warm copy of as many bytes as the padded output, split over
  as many threads as the pool has: the floor on this machine.

Other code can time its own collation beside these: `register` adds a
`Strategy`, which `run_shape` and `torch-r3 bench --strategies` then accept by
name (a checkout's `benchmarks/peers.py` registers the peers' collations this
way, and `python -m benchmarks.compare` times them side by side).

Every strategy writes plain (`pin_memory=False`) memory, so that all of them
allocate the same kind of buffer. The floors' buffers are plain outputs too
(`BufferPool(cache_bytes=0).empty`): hugepage-backed where the kernel
gives torch_r3's outputs hugepages, small pages where it does not, so a floor
is always like-for-like with what it judges.

The check that they agree (`Reference`, `check_identical`, `packed_from_padded`)
is `torch_r3.bench.reference`'s; this module re-exports it under its 0.2.0 path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_r3 import BufferPool
from torch_r3._checks import check_choice, check_positive
from torch_r3.bench.config import TORCH_DTYPES, Batch
from torch_r3.bench.reference import Reference, check_identical, packed_from_padded  # their 0.2.0 path, kept
from torch_r3.collate.collator import collate_routes
from torch_r3.collate.layout import Memory
from torch_r3.cpu import pool_workers
from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS, ROUTER_MASK, ROUTES

__all__ = [
    "FLOORS",
    "FRESH",
    "GATHER",
    "MEMCPY",
    "PACKED",
    "PACKED_GATHER",
    "PACKED_STEADY",
    "REUSED",
    "SERIAL",
    "STEADY",
    "STRATEGIES",
    "Context",
    "Reference",
    "Strategy",
    "check_identical",
    "get_strategy",
    "packed_from_padded",
    "parallel_copy",
    "register",
    "registered",
    "run_strategy",
    "unregister",
]

SERIAL = "single-write serial"
FRESH = "torch_r3 fresh"
REUSED = "torch_r3 reused"
STEADY = "torch_r3 steady"
PACKED = "torch_r3 packed"
MEMCPY = "memcpy limit"
PACKED_STEADY = "torch_r3 packed steady"
GATHER = "gather floor"
PACKED_GATHER = "packed gather floor"
#: The strategies that are floors (what a collation cannot beat), not collations.
FLOORS = (GATHER, PACKED_GATHER, MEMCPY)
# Bytes of the gather floors' padding template: a few rows that stay in the core's caches.
_TEMPLATE_BYTES = 64 << 10


def _plain(nbytes: int) -> np.ndarray:
    """`nbytes` of the memory a fresh plain output gets (see the module docstring)."""
    return BufferPool(cache_bytes=0).empty((nbytes,), torch.uint8).numpy()


class Context:
    """Per-batch state the strategies share: buffers allocated (and touched) once, a copy pool.

    Args:
        batch: the input every strategy collates.
        workers: the pool size every threaded strategy uses.
        strategies: the names that will run, so that only their buffers are made.
    """

    def __init__(self, batch: Batch, workers: int, strategies: Sequence[str]):
        self.batch = batch
        self.workers = workers
        self.out: dict[str, torch.Tensor] | None = None
        self.src: np.ndarray | None = None
        self.dst: np.ndarray | None = None
        self.copy_pool: ThreadPoolExecutor | None = None
        self.buffers = BufferPool() if STEADY in strategies else None
        self.packed_buffers = BufferPool() if PACKED_STEADY in strategies else None
        self.held: dict[str, torch.Tensor] | None = None  # the steady loop's previous batch
        self.held_packed: dict[str, torch.Tensor] | None = None
        self.gather: dict[str, np.ndarray] | None = None
        self.packed_gather: dict[str, np.ndarray] | None = None
        self.template: np.ndarray | None = None
        B, T, L, K = len(batch.routes), batch.T, batch.num_layers, batch.topk
        if GATHER in strategies or PACKED_GATHER in strategies:
            row = L * K * batch.dtype.itemsize
            self.template = np.ascontiguousarray(
                np.broadcast_to(np.arange(K, dtype=batch.dtype), (max(1, _TEMPLATE_BYTES // row), L, K))
            )
        if GATHER in strategies:
            self.gather = _carve(
                {ROUTES: ((B, T, L, K), batch.dtype), ATTENTION_MASK: ((B, T), np.int64), ROUTER_MASK: ((B, T), bool)}
            )
        if PACKED_GATHER in strategies:
            N = sum(batch.token_counts)
            self.packed_gather = _carve(
                {ROUTES: ((N, L, K), batch.dtype), ROUTER_MASK: ((N,), bool), CU_SEQLENS: ((B + 1,), np.int32)}
            )
        if REUSED in strategies:
            # Warm buffers that hold garbage, so that a byte the kernel failed
            # to write shows up in the bit-identical check.
            B, T = len(batch.routes), batch.T
            self.out = {
                ROUTES: torch.full(
                    (B, T, batch.num_layers, batch.topk),
                    -1 if batch.dtype.kind == "i" else 255,
                    dtype=TORCH_DTYPES[batch.dtype.name],
                ),
                ROUTER_MASK: torch.ones((B, T), dtype=torch.bool),
                ATTENTION_MASK: torch.full((B, T), 7, dtype=torch.long),
            }
        if MEMCPY in strategies:
            self.src, self.dst = _plain(batch.padded_bytes), _plain(batch.padded_bytes)
            self.src.fill(1)
            self.dst.fill(0)
        if any(s in strategies for s in FLOORS) and workers > 1:
            self.copy_pool = ThreadPoolExecutor(workers - 1, thread_name_prefix="torch_r3-bench-floor")

    def close(self) -> None:
        """Shut the copy pool down and drop the buffers."""
        if self.copy_pool is not None:
            self.copy_pool.shutdown()
        self.out = self.src = self.dst = self.held = self.buffers = None
        self.held_packed = self.packed_buffers = self.gather = self.packed_gather = None


def _carve(specs: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
    """Arrays of `specs` in one plain buffer, the widest first (aligned), written once so that they are warm."""
    sizes = {k: int(np.prod(shape)) * np.dtype(dt).itemsize for k, (shape, dt) in specs.items()}
    order = sorted(specs, key=lambda k: -np.dtype(specs[k][1]).itemsize)
    memory = _plain(sum(sizes.values()))
    memory.fill(0)
    out, at = {}, 0
    for k in order:
        shape, dt = specs[k]
        out[k] = memory[at : at + sizes[k]].view(dt).reshape(shape)
        at += sizes[k]
    return out


def _balanced(costs: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges of `costs` of about equal sum."""
    total, acc, lo = sum(costs), 0, 0
    bounds: list[tuple[int, int]] = []
    for i, c in enumerate(costs):
        acc += c
        if len(bounds) < parts - 1 and acc >= total * (len(bounds) + 1) / parts:
            bounds.append((lo, i + 1))
            lo = i + 1
    bounds.append((lo, len(costs)))
    return bounds


def _on_threads(ctx: Context, write: Callable[[int, int], None], costs: Sequence[int]) -> None:
    """`write(lo, hi)` over trajectories split into `ctx.workers` groups of equal cost, one on this thread."""
    parts = _balanced(costs, ctx.workers if ctx.copy_pool else 1)
    futures = [ctx.copy_pool.submit(write, lo, hi) for lo, hi in parts[1:]] if ctx.copy_pool else []
    write(*parts[0])
    for f in futures:
        f.result()


def _pad(dst: np.ndarray, template: np.ndarray) -> None:
    step = template.shape[0]
    for lo in range(0, dst.shape[0], step):
        part = dst[lo : lo + step]
        np.copyto(part, template[: part.shape[0]])


def parallel_copy(dst: np.ndarray, src: np.ndarray, workers: int, pool: ThreadPoolExecutor | None) -> None:
    """Copy `src` into `dst` (1-D, same size) in `workers` contiguous slices, one on this thread.

    Args:
        dst: the destination bytes.
        src: the source bytes.
        workers: slices, one per thread.
        pool: at least `workers - 1` threads (None when `workers == 1`).
    """
    n = src.nbytes
    bounds = [(n * k // workers, n * (k + 1) // workers) for k in range(workers)]
    futures = [pool.submit(np.copyto, dst[lo:hi], src[lo:hi]) for lo, hi in bounds[1:]] if pool else []
    lo, hi = bounds[0] if pool else (0, n)
    np.copyto(dst[lo:hi], src[lo:hi])
    for f in futures:
        f.result()


def _serial(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3's kernel on one thread: each byte written once, no prefill, a fresh output."""
    # The kernel itself on the calling thread: the same writes as torch_r3
    # fresh, so the difference between the two is exactly the pool.
    b = ctx.batch
    return collate_routes(
        b.routes,
        b.token_counts,
        memory=Memory(workers=1, pin_memory=False),
    )


def _fresh(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3 with its copy pool into a fresh output (a first batch, and every DataLoader-worker batch)."""
    b = ctx.batch
    return collate_routes(
        b.routes,
        b.token_counts,
        memory=Memory(workers=ctx.workers, pin_memory=False),
    )


def _reused(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3 into caller-owned out= buffers."""
    b = ctx.batch
    return collate_routes(b.routes, b.token_counts, memory=Memory(workers=ctx.workers), out=ctx.out)


def _steady(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3 with a BufferPool, the previous batch held: what R3Collator does in a training loop."""
    b = ctx.batch
    # `ctx.held` is the loop variable of `for batch in loader`: it keeps the
    # previous batch alive while this one is collated (so its buffer cannot be
    # reused), and rebinding it afterwards hands that buffer back to the pool.
    out = collate_routes(
        b.routes,
        b.token_counts,
        memory=Memory(workers=ctx.workers, pin_memory=False, buffers=ctx.buffers),
    )
    ctx.held = out
    return out


def _packed(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3, packed (THD) layout, a fresh output."""
    b = ctx.batch
    return collate_routes(
        b.routes,
        b.token_counts,
        layout="packed",
        memory=Memory(workers=ctx.workers, pin_memory=False),
    )


def _packed_steady(ctx: Context) -> dict[str, torch.Tensor]:
    """torch_r3, packed layout, with a BufferPool as in a training loop."""
    b = ctx.batch
    out = collate_routes(
        b.routes,
        b.token_counts,
        layout="packed",
        memory=Memory(workers=ctx.workers, pin_memory=False, buffers=ctx.packed_buffers),
    )
    ctx.held_packed = out  # as `torch_r3 steady`: the loop holds the previous batch
    return out


def _gather(ctx: Context) -> dict[str, torch.Tensor]:
    """floor: the batch's own sources copied where they live into a warm padded output, on the pool's threads."""
    b, out, template = ctx.batch, ctx.gather, ctx.template
    assert out is not None and template is not None  # made by Context for this strategy
    routes, mask, att = out[ROUTES], out[ROUTER_MASK], out[ATTENTION_MASK]
    T = b.T

    def write(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            src, n = b.routes[i], b.token_counts[i]
            s = T - n
            e = s + src.shape[0]
            _pad(routes[i, :s], template)
            np.copyto(routes[i, s:e], src, casting="safe")
            _pad(routes[i, e:], template)
            mask[i, :s], mask[i, s:e], mask[i, e:] = True, False, True
            att[i, :s], att[i, s:] = 0, 1

    _on_threads(ctx, write, [T] * len(b.routes))
    return {k: torch.from_numpy(v) for k, v in out.items()}


def _packed_gather(ctx: Context) -> dict[str, torch.Tensor]:
    """floor: the same for the packed layout."""
    b, out, template = ctx.batch, ctx.packed_gather, ctx.template
    assert out is not None and template is not None  # made by Context for this strategy
    routes, mask, cu = out[ROUTES], out[ROUTER_MASK], out[CU_SEQLENS]
    cu[0] = 0
    np.cumsum(b.token_counts, out=cu[1:])
    starts = cu.tolist()

    def write(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            src, s = b.routes[i], starts[i]
            e = s + src.shape[0]
            np.copyto(routes[s:e], src, casting="safe")
            _pad(routes[e : starts[i + 1]], template)
            mask[s:e], mask[e : starts[i + 1]] = False, True

    _on_threads(ctx, write, b.token_counts)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def _memcpy(ctx: Context) -> None:
    """floor: one warm contiguous copy of as many bytes as the padded output, on the pool's threads."""
    assert ctx.dst is not None and ctx.src is not None  # made by Context for this strategy
    parallel_copy(ctx.dst, ctx.src, ctx.workers, ctx.copy_pool)


@dataclass(frozen=True)
class Strategy:
    """One way of collating a batch.

    `call` gets the run's `Context` (its `batch` is the input) and returns the
    batch it made, as `torch_r3.collate_routes` returns it, or None for a
    strategy that writes no batch. `layout` is the layout of its output
    (`padded` or `packed`), or None for a strategy that writes no batch
    (`memcpy limit`). `loop_calls` is how many consecutive calls its memory is
    measured over: 1, or more for a strategy whose cost shows only in a loop.
    `floor` marks a floor (it writes into warm memory it owns and allocates
    nothing), not a collation. `description` is the one line the report prints
    under its table (default: the first line of `call`'s docstring).
    """

    name: str
    call: Callable[[Context], dict[str, torch.Tensor] | None]
    layout: str | None
    loop_calls: int = 1
    floor: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or "," in self.name:
            raise ValueError(f"a strategy's name must be a non-empty str without commas, got {self.name!r}")
        if not callable(self.call):
            raise TypeError(f"strategy {self.name!r}: call must be callable, got {type(self.call).__name__}")
        check_choice(self.layout, f"strategy {self.name!r}: layout", ("padded", "packed", None))
        check_positive(self.loop_calls, f"strategy {self.name!r}: loop_calls")
        if not self.description:
            first = (getattr(self.call, "__doc__", None) or "").strip().split("\n")[0]
            object.__setattr__(self, "description", first.rstrip("."))


_REGISTRY: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(SERIAL, _serial, "padded"),
        Strategy(FRESH, _fresh, "padded"),
        Strategy(REUSED, _reused, "padded"),
        # Four calls: the pool's first buffer, a second while the first is held,
        # then two that reuse them. The peak must stay at two batches.
        Strategy(STEADY, _steady, "padded", loop_calls=4),
        Strategy(PACKED, _packed, "packed"),
        Strategy(PACKED_STEADY, _packed_steady, "packed", loop_calls=4),
        Strategy(GATHER, _gather, "padded", floor=True),
        Strategy(PACKED_GATHER, _packed_gather, "packed", floor=True),
        Strategy(MEMCPY, _memcpy, None, floor=True),
    )
}

#: torch_r3's own strategies and the floors, in the order a default run times and reports them.
STRATEGIES = tuple(_REGISTRY)


def register(strategy: Strategy) -> Strategy:
    """Add `strategy` to the ones a run can time, by its name.

    Registered strategies are timed only when asked for by name (`run_shape`'s
    `strategies`, `torch-r3 bench --strategies`); a default run times
    `STRATEGIES`. A registered strategy's output is checked bit-identical to
    the run's first output of its layout, as every other strategy's is. It
    gets the run's `Context`: `ctx.batch` is the input and `ctx.workers` the
    pool size the threaded strategies use; buffers it wants it makes itself.

    Args:
        strategy: its name must not be registered yet.

    Returns:
        `strategy`.

    Raises:
        TypeError: `strategy` is not a `Strategy`.
        ValueError: a strategy of that name is registered already.

    Examples:
        >>> from torch_r3 import Memory, collate_routes
        >>> def two_threads(ctx):
        ...     return collate_routes(ctx.batch.routes, ctx.batch.token_counts, memory=Memory(workers=2, pin_memory=False))
        >>> strategy = register(Strategy("two threads", two_threads, "padded", description="the pool, two threads"))
        >>> "two threads" in registered() and "two threads" not in STRATEGIES
        True
        >>> unregister("two threads")
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"register takes a torch_r3.bench.strategies.Strategy, got {type(strategy).__name__}")
    if strategy.name in _REGISTRY:
        raise ValueError(f"a strategy named {strategy.name!r} is registered already")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    """Remove the registered strategy called `name` (torch_r3's own `STRATEGIES` stay).

    Raises:
        ValueError: `name` is one of `STRATEGIES`, or no strategy of that name is registered.
    """
    if name in STRATEGIES:
        raise ValueError(f"{name!r} is one of torch_r3's own strategies; only registered ones can be removed")
    check_choice(name, "registered strategy", [n for n in _REGISTRY if n not in STRATEGIES])
    del _REGISTRY[name]


def registered() -> dict[str, Strategy]:
    """Every strategy a run can time, by name: `STRATEGIES` first, then the registered ones in order (a copy)."""
    return dict(_REGISTRY)


def get_strategy(name: str) -> Strategy:
    """The `Strategy` called `name`.

    Raises:
        ValueError: `name` is not one of `registered()`.
    """
    check_choice(name, "strategy", tuple(_REGISTRY))
    return _REGISTRY[name]


def run_strategy(name: str, batch: Batch, workers: int | None = None) -> dict[str, torch.Tensor] | None:
    """Run one strategy once on `batch` and return its output (None for `memcpy limit`).

    Args:
        name: one of `registered()`.
        batch: from `torch_r3.bench.make_batch`.
        workers: pool workers (default `torch_r3.cpu.pool_workers()`).

    Returns:
        The strategy's output dict, as `torch_r3.collate_routes` returns it.
    """
    strategy = get_strategy(name)
    ctx = Context(batch, workers or pool_workers(), [name])
    try:
        return strategy.call(ctx)
    finally:
        ctx.close()
