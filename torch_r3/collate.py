"""The collation kernel: per-trajectory route arrays -> one training batch.

``collate_routes`` is the kernel; ``R3Collator`` wraps it as a ``collate_fn`` for
``torch.utils.data.DataLoader``. Both follow the layouts fixed in DESIGN.md:

* ``padded``: ``rollout_expert_indices [B, T, L, K]``, right-aligned like a
  left-padded token batch; ``router_padding_mask [B, T]`` (True = no captured
  route); ``attention_mask [B, T]``.
* ``packed``: ``rollout_expert_indices [sum(n), L, K]``, ``router_padding_mask
  [sum(n)]`` and ``cu_seqlens [B + 1]`` for THD training.

How it stays fast: the output is allocated uninitialised and every byte is
written exactly once, row by row, by a small thread pool. Padding regions are
copied from a precomputed padding template (one memcpy per region) instead of
broadcasting a ``[L, K]`` row element by element. NumPy releases the GIL for
large copies, so the threads really run in parallel, and they also share the
first-touch page faults of a fresh buffer.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from torch_r3.cpu import pool_workers, usable_cpus, DEFAULT_POOL_CAP, ENV_NUM_WORKERS
from torch_r3.routes import CANONICAL_DTYPES, widest

__all__ = ["R3Collator", "collate_routes", "padded_length", "padding_rows"]

LAYOUTS = ("padded", "packed")
PADDINGS = ("arange", "balanced")

# Output keys of the kernel.
ROUTES = "rollout_expert_indices"
ROUTER_MASK = "router_padding_mask"
ATTENTION_MASK = "attention_mask"
CU_SEQLENS = "cu_seqlens"
INPUT_IDS = "input_ids"

# Below this many output bytes a pool costs more than it saves.
_SERIAL_BELOW_BYTES = 4 << 20
# Chunks handed out per worker: enough for load balance, few enough that the
# per-chunk Python overhead (which holds the GIL) stays negligible.
_CHUNKS_PER_WORKER = 4

_NP_TO_TORCH = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
}


# --------------------------------------------------------------------------
# Padding routes
# --------------------------------------------------------------------------


def _padding_period(padding: str, topk: int, num_experts: int | None) -> int:
    """Rows after which the padding pattern repeats."""
    if padding == "arange":
        return 1
    return num_experts // math.gcd(topk, num_experts)


def padding_rows(
    positions: Any,
    num_layers: int,
    topk: int,
    *,
    padding: str = "arange",
    num_experts: int | None = None,
    dtype: Any = np.uint8,
) -> np.ndarray:
    """The padding routes for some token positions, ``[len(positions), L, K]``.

    ``arange`` gives ``0 .. K-1`` in every row; ``balanced`` gives row ``t`` the
    experts ``(t*K + j) % num_experts`` for ``j < K``, so that padding spreads
    over all experts. Every row is ``K`` distinct experts, as Megatron's
    dropless dispatcher needs. The position ``t`` is the row's index along the
    output's token axis (``0 .. T-1`` padded, ``0 .. sum(n)-1`` packed).

    >>> padding_rows([0, 1], 1, 2, padding="balanced", num_experts=3)[:, 0]
    array([[0, 1],
           [2, 0]], dtype=uint8)
    """
    _check_padding(padding, num_experts, topk)
    t = np.asarray(positions, dtype=np.int64).reshape(-1, 1)
    j = np.arange(topk, dtype=np.int64)
    if padding == "arange":
        row = np.broadcast_to(j, (t.shape[0], topk))
    else:
        row = (t * topk + j) % num_experts
    return np.ascontiguousarray(np.broadcast_to(row[:, None, :], (t.shape[0], num_layers, topk)), dtype=dtype)


@functools.lru_cache(maxsize=8)
def _template(padding: str, num_experts: int | None, num_layers: int, topk: int, dtype_str: str, rows: int) -> np.ndarray:
    """A read-only block of ``rows`` padding rows starting at position 0.

    Any padding region ``[a, a+n)`` is the slice ``[a % period, a % period + n)``
    of a template at least ``n + period - 1`` rows long, so one memcpy fills it.
    Cached: steady-state training reuses the same shapes every step.
    """
    tpl = padding_rows(
        np.arange(rows), num_layers, topk, padding=padding, num_experts=num_experts, dtype=np.dtype(dtype_str)
    )
    tpl.flags.writeable = False
    return tpl


def _get_template(padding, num_experts, num_layers, topk, dtype, needed_rows):
    # Round up to a power of two so that nearby lengths share one cache entry.
    rows = 1 << max(needed_rows - 1, 0).bit_length()
    return _template(padding, num_experts, num_layers, topk, dtype.str, rows)


def _check_padding(padding: str, num_experts: int | None, topk: int) -> None:
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer))):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    if padding == "balanced":
        if num_experts is None:
            raise ValueError("padding='balanced' needs num_experts (the model's expert count)")
        if num_experts < topk:
            raise ValueError(
                f"padding='balanced' needs num_experts >= topk to give K distinct experts, "
                f"got num_experts={num_experts}, topk={topk}"
            )


# --------------------------------------------------------------------------
# Validation (everything is checked before any byte is written)
# --------------------------------------------------------------------------


def _as_route_array(sample: Any, i: int) -> np.ndarray:
    if isinstance(sample, torch.Tensor):
        if sample.device.type != "cpu":
            raise TypeError(
                f"routes[{i}]: expected a host array, got a tensor on {sample.device}; "
                f"move it with .cpu() (or compact it with torch_r3.compact_routes)"
            )
        sample = sample.detach().numpy()
    if not isinstance(sample, np.ndarray):
        raise TypeError(
            f"routes[{i}]: expected a NumPy array [rows, layers, topk] of uint8/int16/int32, "
            f"got {type(sample).__name__}"
        )
    if sample.dtype not in CANONICAL_DTYPES:
        raise ValueError(
            f"routes[{i}]: expected a canonical dtype (native uint8, int16 or int32), got {sample.dtype.str} "
            f"({sample.dtype}); compact it on the sender with torch_r3.compact_routes"
        )
    if sample.ndim != 3:
        raise ValueError(f"routes[{i}]: expected shape [rows, layers, topk], got {sample.ndim}-D shape {sample.shape}")
    return sample


def _as_count(value: Any, i: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"token_counts[{i}]: expected an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"token_counts[{i}]: expected a positive token count, got {int(value)}")
    return int(value)


def _check_batch(routes: Any, token_counts: Any):
    if isinstance(routes, (np.ndarray, torch.Tensor)) or not isinstance(routes, Sequence):
        raise TypeError(f"routes: expected a sequence of per-trajectory arrays, got {type(routes).__name__}")
    if len(routes) == 0:
        raise ValueError("routes: expected at least one sample, got an empty batch")
    if isinstance(token_counts, torch.Tensor):
        token_counts = token_counts.tolist()
    elif isinstance(token_counts, np.ndarray):
        token_counts = list(token_counts)
    if not isinstance(token_counts, Sequence):
        raise TypeError(f"token_counts: expected a sequence of ints, got {type(token_counts).__name__}")
    if len(token_counts) != len(routes):
        raise ValueError(f"token_counts: expected {len(routes)} counts (one per sample), got {len(token_counts)}")
    arrays = [_as_route_array(r, i) for i, r in enumerate(routes)]
    counts = [_as_count(c, i) for i, c in enumerate(token_counts)]
    _, num_layers, topk = arrays[0].shape
    if num_layers == 0 or topk == 0:
        raise ValueError(f"routes[0]: layers and topk must be > 0, got shape {arrays[0].shape}")
    for i, (a, n) in enumerate(zip(arrays, counts)):
        if a.shape[1:] != (num_layers, topk):
            raise ValueError(
                f"routes[{i}]: expected [rows, {num_layers}, {topk}] like routes[0], got shape {a.shape}"
            )
        if a.shape[0] > n:
            raise ValueError(
                f"routes[{i}]: {a.shape[0]} route rows for {n} tokens; captured rows must be a prefix "
                f"of the trajectory's tokens (rows <= tokens)"
            )
    # Promotion by dtype alone: the sender compacted, so no value is rescanned.
    dtype = widest({a.dtype for a in arrays})
    return arrays, counts, num_layers, topk, dtype


def padded_length(token_counts: Sequence[int], pad_to_multiple_of: int | None = None) -> int:
    """``T`` of the padded layout: the longest trajectory, rounded up to a multiple.

    >>> padded_length([3, 5], pad_to_multiple_of=4)
    8
    """
    longest = max(int(n) for n in token_counts)
    if pad_to_multiple_of is None:
        return longest
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, (int, np.integer)):
        raise TypeError(f"pad_to_multiple_of must be an int, got {type(pad_to_multiple_of).__name__}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    return -(-longest // pad_to_multiple_of) * pad_to_multiple_of


# --------------------------------------------------------------------------
# Output memory
# --------------------------------------------------------------------------


def _accelerator_available() -> bool:
    try:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "is_available"):
            return bool(acc.is_available())
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is "no accelerator", never an error here
        return False


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def _memory_kind(pin_memory: bool | None) -> str:
    """'shared' inside a DataLoader worker, 'pinned' where it helps, else 'plain'."""
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be None, True or False, got {type(pin_memory).__name__}")
    if _in_worker():
        # As default_collate does: the batch crosses to the main process
        # through shared memory without another copy. Pinning happens there.
        return "shared"
    if pin_memory is False:
        return "plain"
    if _accelerator_available():
        return "pinned"
    if pin_memory:
        warnings.warn("pin_memory=True but no accelerator is available; using plain memory", stacklevel=3)
    return "plain"


def _empty(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    if kind == "shared":
        # _new_shared maps fresh shared memory; share_memory_() on an existing
        # tensor would instead copy it, writing the buffer a second time.
        numel = math.prod(shape)
        storage = torch.UntypedStorage._new_shared(max(numel, 1) * torch.empty((), dtype=dtype).element_size())
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    if kind == "pinned":
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # driver present but unusable: plain memory, never an error
            pass
    return torch.empty(shape, dtype=dtype)


def _check_out(out: Any, want: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        out = {ROUTES: out}
    if not isinstance(out, Mapping):
        raise TypeError(f"out: expected a tensor (for {ROUTES}) or a dict of tensors, got {type(out).__name__}")
    for key, t in out.items():
        if key not in want:
            raise ValueError(f"out: unexpected key {key!r}; expected some of {sorted(want)}")
        shape, dtype = want[key]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"out[{key!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"out[{key!r}]: expected shape {list(shape)} and dtype {dtype}, "
                f"got shape {list(t.shape)} and dtype {t.dtype}"
            )
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"out[{key!r}]: expected a contiguous CPU tensor, got device {t.device}, "
                             f"contiguous={t.is_contiguous()}")
    return dict(out)


# --------------------------------------------------------------------------
# The worker pool (one per process, created lazily)
# --------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _reset_after_fork() -> None:
    # A pool's threads do not survive fork(): the child gets the executor
    # object but not its threads, and work submitted to it would never run.
    global _pool_lock, _pools
    _pool_lock = threading.Lock()
    _pools = {}
    _machine_workers.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="torch_r3-collate")
        return pool


@functools.lru_cache(maxsize=None)
def _machine_workers(dataloader_workers: int) -> int:
    # Reading the cgroup tree costs ~0.1 ms; the answer does not change while
    # the process runs, so it is read once per process (and again after fork).
    if dataloader_workers == 0:
        return pool_workers()
    # Inside a DataLoader worker the CPUs are already shared by num_workers
    # processes: give each its share rather than oversubscribing.
    return max(1, min(DEFAULT_POOL_CAP, math.floor(usable_cpus() / dataloader_workers)))


def _default_workers() -> int:
    if os.environ.get(ENV_NUM_WORKERS, "").strip():
        return pool_workers()  # the override, validated there
    info = torch.utils.data.get_worker_info()
    return _machine_workers(0 if info is None else info.num_workers)


def _check_workers(workers: Any) -> int:
    if workers is None:
        return _default_workers()
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)):
        raise TypeError(f"workers must be None or an int, got {type(workers).__name__}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return int(workers)


def _run(costs: list[int], run_range, workers: int, total_bytes: int) -> None:
    """Run ``run_range(lo, hi)`` over contiguous chunks of the rows ``0 .. len(costs)-1``; the caller joins in."""
    n = len(costs)
    if workers <= 1 or n <= 1 or total_bytes < _SERIAL_BELOW_BYTES:
        run_range(0, n)
        return
    # Contiguous chunks of about equal bytes, handed out dynamically.
    target = max(1, sum(costs) // (workers * _CHUNKS_PER_WORKER))
    bounds, acc, lo = [], 0, 0
    for i, c in enumerate(costs):
        acc += c
        if acc >= target:
            bounds.append((lo, i + 1))
            lo, acc = i + 1, 0
    if lo < n:
        bounds.append((lo, n))
    it = iter(bounds)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                b = next(it, None)
            if b is None:
                return
            run_range(*b)

    pool = _pool(workers - 1)
    futures = [pool.submit(drain) for _ in range(min(workers - 1, len(bounds) - 1))]
    # The calling thread drains too, so a call always completes even when other
    # callers' chunks occupy the pool threads.
    drain()
    for f in futures:
        f.result()


# --------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------


class _SeqField:
    """A per-token sequence collated alongside the routes (input_ids, loss_mask, ...)."""

    __slots__ = ("key", "arrays", "pad", "dtype")

    def __init__(self, key: str, arrays: list[np.ndarray], pad: Any, dtype: torch.dtype):
        self.key, self.arrays, self.pad, self.dtype = key, arrays, pad, dtype


def _collate(
    arrays: list[np.ndarray],
    counts: list[int],
    num_layers: int,
    topk: int,
    dtype: np.dtype,
    *,
    layout: str,
    pad_to_multiple_of: int | None,
    padding: str,
    num_experts: int | None,
    workers: int,
    out: Any,
    pin_memory: bool | None,
    fields: Sequence[_SeqField] = (),
) -> dict[str, torch.Tensor]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_padding(padding, num_experts, topk)
    B = len(arrays)
    rows = [a.shape[0] for a in arrays]
    row_shape = (num_layers, topk)
    tdtype = _NP_TO_TORCH[dtype]
    kind = _memory_kind(pin_memory)
    period = _padding_period(padding, topk, num_experts)

    if layout == "padded":
        T = padded_length(counts, pad_to_multiple_of)
        want = {
            ROUTES: ((B, T) + row_shape, tdtype),
            ROUTER_MASK: ((B, T), torch.bool),
            ATTENTION_MASK: ((B, T), torch.long),
        }
        for f in fields:
            want[f.key] = ((B, T), f.dtype)
        longest_pad = max(max(T - r for r in rows), 1)
    else:
        if pad_to_multiple_of is not None:
            raise ValueError("pad_to_multiple_of applies to layout='padded' only; the packed layout has no padding")
        N = sum(counts)
        want = {ROUTES: ((N,) + row_shape, tdtype), ROUTER_MASK: ((N,), torch.bool), CU_SEQLENS: ((B + 1,), torch.int32)}
        for f in fields:
            want[f.key] = ((N,), f.dtype)
        longest_pad = max(max(n - r for n, r in zip(counts, rows)), 1)
        if N >= 2**31:
            raise ValueError(f"packed batch of {N} tokens does not fit int32 cu_seqlens")

    given = _check_out(out, want)
    result = {k: given[k] if k in given else _empty(shape, dt, kind) for k, (shape, dt) in want.items()}
    views = {k: v.numpy() for k, v in result.items()}
    routes_out, mask_out = views[ROUTES], views[ROUTER_MASK]
    tpl = _get_template(padding, num_experts, num_layers, topk, dtype, longest_pad + period - 1)
    fviews = [(views[f.key], f.arrays, f.pad) for f in fields]

    def fill_pad(dst: np.ndarray, start: int, length: int) -> None:
        # One memcpy from the template instead of broadcasting a [L, K] row.
        if length:
            o = start % period
            np.copyto(dst, tpl[o : o + length])

    if layout == "padded":
        att_out = views[ATTENTION_MASK]

        def run_range(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                n, r = counts[i], rows[i]
                s = T - n  # first real token
                e = s + r  # end of captured rows
                dst = routes_out[i]
                fill_pad(dst[:s], 0, s)
                np.copyto(dst[s:e], arrays[i], casting="safe")
                fill_pad(dst[e:], e, T - e)
                m = mask_out[i]
                m[:s] = True
                m[s:e] = False
                m[e:] = True
                a = att_out[i]
                a[:s] = 0
                a[s:] = 1
                for fo, fa, pad in fviews:
                    fo[i, :s] = pad
                    fo[i, s:] = fa[i]

        costs = [T] * B
    else:
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        views[CU_SEQLENS][:] = cu

        def run_range(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                c, n, r = int(cu[i]), counts[i], rows[i]
                np.copyto(routes_out[c : c + r], arrays[i], casting="safe")
                fill_pad(routes_out[c + r : c + n], c + r, n - r)
                mask_out[c : c + r] = False
                mask_out[c + r : c + n] = True
                for fo, fa, _pad in fviews:
                    fo[c : c + n] = fa[i]

        costs = counts

    _run(costs, run_range, workers, routes_out.nbytes)
    return result


def collate_routes(
    routes: Sequence[Any],
    token_counts: Sequence[int],
    *,
    layout: str = "padded",
    pad_to_multiple_of: int | None = None,
    padding: str = "arange",
    num_experts: int | None = None,
    workers: int | None = None,
    out: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    pin_memory: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Collate per-trajectory route arrays into one training batch.

    Args:
        routes: one array ``[r_i, L, K]`` per trajectory, of a canonical dtype
            (``uint8``/``int16``/``int32``; CPU tensors of those dtypes too).
            Read-only and non-contiguous arrays are fine. A mixed batch promotes
            to the widest dtype, by dtype alone.
        token_counts: ``n_i``, the trajectory's token count, ``n_i >= r_i``.
            Captured rows are a prefix of the tokens; the tail is padding.
        layout: ``"padded"`` (left-padded ``[B, T, L, K]``) or ``"packed"``
            (``[sum(n), L, K]`` with ``cu_seqlens``).
        pad_to_multiple_of: round ``T`` up to a multiple (padded layout only).
        padding: ``"arange"`` (experts ``0..K-1``) or ``"balanced"`` (row ``t``
            uses ``(t*K + j) % num_experts``; needs ``num_experts >= K``).
        num_experts: the model's expert count, for ``balanced``.
        workers: copy threads; default :func:`torch_r3.cpu.pool_workers` (in a
            DataLoader worker, its share of the usable CPUs). ``1`` runs on the
            calling thread.
        out: caller-owned buffers to write into: a tensor for
            ``rollout_expert_indices`` or a dict with some of the output keys,
            each of exactly the output's shape and dtype (warm memory, no page
            faults in steady state).
        pin_memory: ``None`` pins when an accelerator exists and the call is
            in the main process; ``True``/``False`` force it (never an error
            on a CPU-only machine). Inside a DataLoader worker the output goes
            to shared memory instead.

    Returns:
        ``rollout_expert_indices``, ``router_padding_mask`` and, padded,
        ``attention_mask``; packed, ``cu_seqlens`` (``torch.int32``).

    Example:
        >>> import numpy as np, torch
        >>> a = np.array([[[5, 6]], [[7, 8]]], dtype=np.uint8)   # 2 rows, 1 layer, top-2
        >>> b = np.array([[[9, 1]]], dtype=np.uint8)             # 1 row
        >>> batch = collate_routes([a, b], [2, 3])
        >>> routes = batch["rollout_expert_indices"]
        >>> routes[:, :, 0].tolist()
        [[[0, 1], [5, 6], [7, 8]], [[9, 1], [0, 1], [0, 1]]]
        >>> batch["router_padding_mask"].tolist()
        [[True, False, False], [False, True, True]]
        >>> batch["attention_mask"].tolist()
        [[0, 1, 1], [1, 1, 1]]
    """
    arrays, counts, num_layers, topk, dtype = _check_batch(routes, token_counts)
    return _collate(
        arrays,
        counts,
        num_layers,
        topk,
        dtype,
        layout=layout,
        pad_to_multiple_of=pad_to_multiple_of,
        padding=padding,
        num_experts=num_experts,
        workers=_check_workers(workers),
        out=out,
        pin_memory=pin_memory,
    )


# --------------------------------------------------------------------------
# The DataLoader collate_fn
# --------------------------------------------------------------------------


def _seq_to_numpy(value: Any, i: int, key: str, *, integer: bool) -> np.ndarray:
    """One sample's per-token sequence as a 1-D NumPy array (no copy for arrays/tensors)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        arr = value.numpy()
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        if not value:
            arr = np.zeros(0, dtype=np.int64)
        else:
            # torch.as_tensor's rules: Python ints -> int64, floats -> default dtype.
            arr = torch.as_tensor(value).numpy()
    else:
        raise TypeError(
            f"sample {i}: {key!r} must be a list, NumPy array or 1-D tensor, got {type(value).__name__}"
        )
    if arr.ndim != 1:
        raise ValueError(f"sample {i}: {key!r} must be 1-D, got shape {arr.shape}")
    if integer and arr.dtype.kind not in "iu":
        raise TypeError(f"sample {i}: {key!r} must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"sample {i}: {key!r} must be numeric, got dtype {arr.dtype}")
    return arr


def _torch_dtype_of(arrays: list[np.ndarray]) -> torch.dtype:
    dt = torch.from_numpy(np.empty(0, dtype=arrays[0].dtype)).dtype
    for a in arrays[1:]:
        dt = torch.promote_types(dt, torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype)
    return dt


def _check_pad_value(pad: Any, dtype: torch.dtype, key: str) -> Any:
    if isinstance(pad, bool) or not isinstance(pad, (int, float)):
        if not (dtype == torch.bool and isinstance(pad, bool)):
            raise TypeError(f"pad value for {key!r} must be a number, got {type(pad).__name__}")
    if dtype == torch.bool:
        if pad not in (0, 1):
            raise ValueError(f"pad value for {key!r} must be 0/1/False/True for a bool sequence, got {pad!r}")
        return bool(pad)
    if not dtype.is_floating_point:
        if float(pad) != int(pad):
            raise ValueError(f"pad value {pad!r} for {key!r} is not representable in {dtype}")
        info = torch.iinfo(dtype)
        if not info.min <= int(pad) <= info.max:
            raise ValueError(f"pad value {pad!r} for {key!r} does not fit {dtype}")
        return int(pad)
    return float(pad)


class R3Collator:
    """``collate_fn`` for ``torch.utils.data.DataLoader`` batches of R3 samples.

    A sample is a mapping with the trajectory's routes (``routes_key``, an array
    ``[r_i, L, K]`` of a canonical dtype) and its tokens (``tokens_key``, a list,
    NumPy array or 1-D tensor of token ids). The batch holds ``input_ids``
    (left-padded with ``pad_token_id``), ``attention_mask``,
    ``rollout_expert_indices`` and ``router_padding_mask`` (packed: ``input_ids``
    ``[sum(n)]``, ``cu_seqlens``, no attention mask). Keys in ``pad_keys``
    (per-token sequences as long as the tokens, e.g. ``loss_mask``) are padded
    the same way with their pad value; every other key is collated by
    ``torch.utils.data.default_collate``.

    Picklable (spawn-started workers), safe after ``fork`` (its thread pool is
    created lazily in each process) and safe to call from several threads.

    Example:
        >>> import numpy as np
        >>> from torch.utils.data import DataLoader
        >>> samples = [
        ...     {"input_ids": [11, 12, 13], "routes": np.zeros((2, 4, 2), np.uint8), "reward": 1.0},
        ...     {"input_ids": [21], "routes": np.zeros((0, 4, 2), np.uint8), "reward": 0.0},
        ... ]
        >>> loader = DataLoader(samples, batch_size=2, collate_fn=R3Collator(pad_token_id=0))
        >>> batch = next(iter(loader))
        >>> batch["input_ids"].tolist(), batch["rollout_expert_indices"].shape
        ([[11, 12, 13], [0, 0, 21]], torch.Size([2, 3, 4, 2]))
        >>> batch["router_padding_mask"].tolist(), batch["reward"].tolist()
        ([[False, False, True], [True, True, True]], [1.0, 0.0])
    """

    def __init__(
        self,
        *,
        routes_key: str = "routes",
        tokens_key: str = "input_ids",
        layout: str = "padded",
        pad_token_id: int = 0,
        pad_keys: Mapping[str, float] | Sequence[str] = (),
        pad_to_multiple_of: int | None = None,
        padding: str = "arange",
        num_experts: int | None = None,
        workers: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise TypeError(f"pad_token_id must be an int, got {type(pad_token_id).__name__}")
        if isinstance(pad_keys, str):
            raise TypeError("pad_keys must be a mapping {key: pad value} or a sequence of keys, not a str")
        self.pad_keys = dict(pad_keys) if isinstance(pad_keys, Mapping) else {k: 0 for k in pad_keys}
        reserved = {routes_key, tokens_key, INPUT_IDS, ROUTES, ROUTER_MASK, ATTENTION_MASK, CU_SEQLENS}
        clash = reserved & set(self.pad_keys)
        if clash:
            raise ValueError(f"pad_keys may not include the routes/tokens/output keys {sorted(clash)}")
        if layout == "padded":
            padded_length([1], pad_to_multiple_of)  # validates the argument up front
        elif pad_to_multiple_of is not None:
            raise ValueError("pad_to_multiple_of applies to layout='padded' only")
        if workers is not None:
            _check_workers(workers)
        self.routes_key = routes_key
        self.tokens_key = tokens_key
        self.layout = layout
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding = padding
        self.num_experts = num_experts
        self.workers = workers
        self.pin_memory = pin_memory
        _check_padding(padding, num_experts, 1)

    def __repr__(self) -> str:
        return (
            f"R3Collator(layout={self.layout!r}, routes_key={self.routes_key!r}, tokens_key={self.tokens_key!r}, "
            f"pad_keys={self.pad_keys!r}, padding={self.padding!r})"
        )

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
            raise TypeError(f"expected a sequence of sample mappings, got {type(samples).__name__}")
        if len(samples) == 0:
            raise ValueError("expected at least one sample, got an empty batch")
        keys0 = None
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping):
                raise TypeError(f"sample {i}: expected a mapping (dict), got {type(s).__name__}")
            for k in (self.routes_key, self.tokens_key, *self.pad_keys):
                if k not in s:
                    raise ValueError(f"sample {i}: missing key {k!r}")
            if self.tokens_key != INPUT_IDS and INPUT_IDS in s:
                raise ValueError(
                    f"sample {i}: has both {self.tokens_key!r} (the tokens key) and {INPUT_IDS!r}, "
                    f"which the batch's padded token ids would overwrite"
                )
            if keys0 is None:
                keys0 = set(s)
            elif set(s) != keys0:
                diff = sorted(set(s) ^ keys0, key=str)
                raise ValueError(f"sample {i}: keys differ from sample 0 in {diff}")

        tokens = [_seq_to_numpy(s[self.tokens_key], i, self.tokens_key, integer=True) for i, s in enumerate(samples)]
        for i, t in enumerate(tokens):
            if t.shape[0] == 0:
                raise ValueError(f"sample {i}: {self.tokens_key!r} is empty; a trajectory needs at least one token")
        counts = [t.shape[0] for t in tokens]
        try:
            arrays, counts, num_layers, topk, dtype = _check_batch([s[self.routes_key] for s in samples], counts)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} [key {self.routes_key!r}]") from None

        fields = [_SeqField(INPUT_IDS, tokens, self.pad_token_id, torch.long)]
        for key, pad in self.pad_keys.items():
            arrs = [_seq_to_numpy(s[key], i, key, integer=False) for i, s in enumerate(samples)]
            for i, (a, n) in enumerate(zip(arrs, counts)):
                if a.shape[0] != n:
                    raise ValueError(f"sample {i}: {key!r} has {a.shape[0]} entries for {n} tokens; expected {n}")
            dt = _torch_dtype_of(arrs)
            fields.append(_SeqField(key, arrs, _check_pad_value(pad, dt, key), dt))

        batch: dict[str, Any] = _collate(
            arrays,
            counts,
            num_layers,
            topk,
            dtype,
            layout=self.layout,
            pad_to_multiple_of=self.pad_to_multiple_of,
            padding=self.padding,
            num_experts=self.num_experts,
            workers=_check_workers(self.workers),
            out=None,
            pin_memory=self.pin_memory,
            fields=fields,
        )
        handled = {self.routes_key, self.tokens_key, *self.pad_keys}
        for key in samples[0]:
            if key not in handled:
                batch[key] = torch.utils.data.default_collate([s[key] for s in samples])
        return batch
