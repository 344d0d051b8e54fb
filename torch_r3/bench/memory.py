"""Memory: what a run needs, what the machine has, and what one strategy call used.

The estimate is an upper bound from the shape alone, checked before anything is
allocated, so that `--preset production` on a laptop is refused with one figure
instead of being killed by the OOM killer half-way. `PeakRss` measures the
resident memory a call (or a loop of calls) added at its peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torch_r3.bench.config import BenchConfig, max_padded_bytes
from torch_r3.bench.units import format_gib
from torch_r3.cpu import cgroup_memory_room

__all__ = [
    "InsufficientMemoryError",
    "PeakRss",
    "available_memory",
    "check_memory",
    "collector_paused",
    "estimate_memory",
    "process_peak_rss",
]

# Kept free on top of the estimate: interpreter, torch, matplotlib, page tables.
_MEMORY_SLACK = 512 << 20
# Padded outputs resident together at a run's peak: the reference (kept for the
# bit-identical checks), the `out=` buffers of `torch_r3 reused`, the source and
# destination of `memcpy limit`, the batch `torch_r3 steady` holds and the one
# its buffer pool keeps, the two gather floors' warm outputs, the two packed
# batches of `torch_r3 packed steady` (a packed batch is never larger than a
# padded one), and one more for a registered strategy's output (a checkout's
# `pad_sequence` peer).
_OUTPUTS_AT_PEAK = 11


class InsufficientMemoryError(RuntimeError):
    """The run needs more memory than this machine (or its cgroup) has available."""


def estimate_memory(config: BenchConfig) -> int:
    """Bytes a run of `config` needs at its peak, from the shape alone (an upper bound).

    Resident together at the peak: the input, one copy of it, and up to eleven
    padded outputs (the reference kept for the checks, the `out=` buffers, the
    memcpy source and destination, the steady loops' batches, the gather
    floors' outputs). The copy and one of the outputs are room for a
    registered strategy that copies its input and writes a fresh output, as a
    checkout's `pad_sequence` peer does. The `--dataloader` mode needs less:
    its batches are an eighth of the input or smaller.

    Args:
        config: the shape.

    Returns:
        Bytes, including a fixed allowance for the interpreter and torch.

    Examples:
        >>> estimate_memory(BenchConfig()) / 2**30 < 10
        True
    """
    L, K = config.num_layers, config.topk
    itemsize = np.dtype(config.dtype).itemsize
    B, T = config.num_sequences, config.max_seqlen
    output = max_padded_bytes(config)
    # uniform has mean max/2; the others are smaller, but bound by the worst case.
    mean_tokens = T if config.distribution != "uniform" else (T + 1) / 2
    inputs = int(B * mean_tokens * L * K * itemsize)
    return 2 * inputs + _OUTPUTS_AT_PEAK * output + _MEMORY_SLACK


def available_memory() -> dict[str, Any]:
    """What this process may still allocate: `MemAvailable` and the cgroup memory room.

    Returns:
        `{"mem_available": bytes or None, "cgroup_room": bytes or None, "cgroup":
        path or None, "available": the smaller of the two known, or None}`.
    """
    mem_available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem_available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    room, cgroup = cgroup_memory_room()
    known = [v for v in (mem_available, room) if v is not None]
    return {
        "mem_available": mem_available,
        "cgroup_room": room,
        "cgroup": cgroup,
        "available": min(known) if known else None,
    }


def check_memory(need: int, what: str, probe: Callable[[], dict[str, Any]] | None = None) -> None:
    """Raise `InsufficientMemoryError` unless `need` bytes are available.

    Args:
        need: the bytes the run needs (`torch_r3.bench.memory_needed`).
        what: the run, for the message (its shape's label).
        probe: returns `available_memory`'s dict (injectable for tests);
            default `available_memory`.

    Raises:
        InsufficientMemoryError: the run needs more than is available; the
            message states `need` and what is available, once each.
    """
    have = (probe or available_memory)()
    avail = have.get("available")
    if avail is not None and need > avail:
        where = f" (cgroup {have['cgroup']})" if have.get("cgroup") and avail == have.get("cgroup_room") else ""
        raise InsufficientMemoryError(
            f"this run ({what}) needs about {format_gib(need)} of memory, but only {format_gib(avail)} is "
            f"available{where}; use a smaller shape (--num-sequences, --max-seqlen) or a bigger machine"
        )


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


_process_peak = 0


def _trim_allocator() -> None:
    """Return the C allocator's free memory to the OS (glibc's `malloc_trim`; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, the peak may read low
        pass


def process_peak_rss() -> int:
    """The process-lifetime peak RSS in bytes, carried across `PeakRss`'s resets of `VmHWM` (0 if unknown)."""
    global _process_peak
    _process_peak = max(_process_peak, _status_bytes("VmHWM:") or 0)
    return _process_peak


class PeakRss:
    """Peak resident memory above the level at entry, for the calls inside a `with` block.

    `ru_maxrss` and `VmHWM` are process-lifetime peaks, so the earlier (and
    larger) strategies would mask the later ones. Linux lets a process reset its
    own `VmHWM` by writing `5` to `/proc/self/clear_refs`: that gives an exact
    peak with no perturbation of the calls. Where that is not allowed, a thread
    samples `VmRSS` every millisecond instead (the outputs stay alive until the
    call returns, so the sampled peak is close). On entry the C allocator's
    free memory is handed back to the OS (`malloc_trim`), so that a call which
    reuses memory freed earlier is charged for it, as a fresh output must be.
    """

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gc_was_enabled = False

    def __enter__(self) -> PeakRss:
        # Memory freed earlier but kept by the C allocator is still resident: a
        # call that reuses it would add nothing to the RSS, and a fresh output
        # would look free. Hand it back first, so that what the call touches counts;
        # and collect now, not during the block, where freeing garbage from before
        # would hide the call's own memory.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        _trim_allocator()
        self.start = _status_bytes("VmRSS:") or 0
        process_peak_rss()  # the reset below would lose the process-lifetime peak
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
            self.peak = max(self.peak, _status_bytes("VmRSS:") or 0)

    def __exit__(self, *exc: object) -> None:
        if self._gc_was_enabled:
            gc.enable()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_bytes("VmRSS:") or 0)
        else:
            self.peak = _status_bytes("VmHWM:") or 0

    @property
    def extra(self) -> int:
        """Bytes the block added at its peak, above the resident level at entry."""
        return max(0, self.peak - self.start)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect once, then keep Python's cyclic collector out of the timed block.

    Outputs are freed by reference counting; the cyclic collector only adds
    noise to the timings (tens of ms with torch loaded).
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
