"""A rank's share of the global batch: plan micro-batches from metadata, collate each on its rank.

At cluster scale the controller keeps only metadata (token counts, route
dtypes) and each trainer rank collates its own micro-batches, fetching only
their trajectories. `plan_microbatches` splits the global batch across
data-parallel ranks from the token counts alone; `ShardCollator` fetches and
collates one rank's micro-batches, each one bit-identical to the matching rows
of the global batch when it is given the global `seq_len` and `dtype`
(`torch_r3.global_geometry`): the micro-batch's global sample indices go to the
collator as `sample_ids`, which key the `balanced` padding.

Examples:
    >>> import numpy as np
    >>> from torch_r3 import Padded, ShardCollator, global_geometry, plan_microbatches
    >>> tokens = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    >>> store = [{"input_ids": t, "routes": np.zeros((len(t) - 1, 2, 2), np.uint8)} for t in tokens]
    >>> counts = [len(t) for t in tokens]
    >>> plan = plan_microbatches(counts, dp_size=2, micro_batch_size=1)
    >>> plan
    [[[3], [1]], [[0], [2]]]
    >>> geometry = global_geometry(counts, {np.uint8})
    >>> shard = ShardCollator(
    ...     lambda idx: [store[i] for i in idx],
    ...     plan[0],
    ...     layout=Padded(seq_len=geometry.seq_len),
    ...     dtype=geometry.dtype,
    ...     pad_token_id=0,
    ... )
    >>> [batch["input_ids"].tolist() for batch in shard]
    [[[7, 8, 9, 10]], [[0, 0, 0, 4]]]
"""

from __future__ import annotations

import concurrent.futures
import heapq
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from torch_r3._checks import check_bool, check_indices, check_positive, check_token_counts
from torch_r3._deprecation import renamed_argument
from torch_r3.collate.collator import R3Collator
from torch_r3.collate.geometry import MAX_SAMPLE_ID, aligned_counts
from torch_r3.collate.layout import LAYOUT_KEYWORDS, MEMORY_KEYWORDS, Layout, Memory, from_keywords
from torch_r3.keys import OUTPUT_KEYS

__all__ = ["ShardCollator", "plan_microbatches"]


def _split_rank(
    members: list[int], counts: list[int], m: int, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]] | None:
    """`members` into `m` non-empty micro-batches balanced by tokens; `None` if the limits do not allow it.

    Longest first, each sample to the least loaded micro-batch that has room
    (ties: fewer samples, then the lower index), in O(n log m): the open
    micro-batches sit in a heap keyed by (tokens, samples, index). A full one
    (`micro_batch_size` samples) leaves the heap for good; and when the least
    loaded open one has no room for a sample's tokens, no open one has.
    """
    bins: list[list[int]] = [[] for _ in range(m)]
    heap = [(0, 0, b) for b in range(m)]  # already a heap: sorted
    for i in sorted(members, key=lambda i: (-counts[i], i)):
        if not heap:
            return None
        load, size, b = heap[0]
        if max_tokens is not None and load + counts[i] > max_tokens:
            return None
        bins[b].append(i)
        if micro_batch_size is not None and size + 1 >= micro_batch_size:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (load + counts[i], size + 1, b))
    return [sorted(b) for b in bins]


def _fewest_microbatches(
    members: list[int], counts: list[int], micro_batch_size: int | None, max_tokens: int | None
) -> int:
    """A lower bound on one rank's micro-batch count that the limits impose."""
    m = 1
    if micro_batch_size is not None:
        m = max(m, -(-len(members) // micro_batch_size))
    if max_tokens is not None:
        m = max(m, -(-sum(counts[i] for i in members) // max_tokens))
        # Two samples of more than half the limit never share a micro-batch.
        m = max(m, sum(1 for i in members if 2 * counts[i] > max_tokens))
    return m


def plan_microbatches(
    token_counts: Sequence[int],
    *,
    dp_size: int,
    micro_batch_size: int | None = None,
    max_tokens_per_microbatch: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> list[list[list[int]]]:
    """Split a global batch into micro-batches per data-parallel rank, from token counts alone.

    Every sample goes to exactly one micro-batch of one rank; every rank gets
    the same number of micro-batches (Megatron's schedule runs the same count
    on every rank), none empty. Ranks are balanced by tokens (and hold within
    one sample of the same count); within a rank the micro-batches are
    balanced by tokens too. Deterministic: the same counts give the same plan
    on every rank. Indices within a micro-batch are ascending. Fast enough to
    run on every rank every step: O(n log n) per micro-batch count tried, and
    O(log n) counts tried (8192 samples in tens of milliseconds).

    Args:
        token_counts: every trajectory's token count (positive ints), in
            global batch order.
        dp_size: data-parallel ranks.
        micro_batch_size: the most samples per micro-batch.
        max_tokens_per_microbatch: the most tokens per micro-batch (a
            trajectory longer than this is refused). Without either limit,
            each rank gets one micro-batch.
        pad_to_multiple_of: count every trajectory as its aligned length
            (rounded up to this multiple), the tokens a packed batch collated
            with the same `pad_to_multiple_of` holds: balancing and
            `max_tokens_per_microbatch` then count what the model computes.

    Returns:
        `plan[rank][k]`: the global sample indices of rank `rank`'s `k`-th micro-batch.

    Raises:
        TypeError: a count or setting of the wrong kind, naming it.
        ValueError: fewer samples than ranks, a trajectory over the token
            limit, or limits that need more micro-batches than a rank has samples.

    Examples:
        >>> plan_microbatches([5, 1, 4, 2, 3, 3], dp_size=2, micro_batch_size=2)
        [[[0], [1, 5]], [[2], [3, 4]]]
    """
    counts = check_token_counts(token_counts)
    if pad_to_multiple_of is not None:
        counts = aligned_counts(counts, check_positive(pad_to_multiple_of, "pad_to_multiple_of"))
    dp = check_positive(dp_size, "dp_size")
    mbs = None if micro_batch_size is None else check_positive(micro_batch_size, "micro_batch_size")
    cap = (
        None
        if max_tokens_per_microbatch is None
        else check_positive(max_tokens_per_microbatch, "max_tokens_per_microbatch")
    )
    if len(counts) < dp:
        raise ValueError(f"token_counts: {len(counts)} samples cannot give each of dp_size={dp} ranks one")
    if cap is not None:
        for i, n in enumerate(counts):
            if n > cap:
                raise ValueError(f"sample {i} has {n} tokens, more than max_tokens_per_microbatch={cap}")
    # Ranks: in rounds of dp samples, longest first, each to the least loaded rank
    # of the round, so the sample counts differ by at most one.
    members: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    for start in range(0, len(order), dp):
        chunk = order[start : start + dp]
        ranks = sorted(range(dp), key=lambda r: (load[r], r))[: len(chunk)]
        for i, r in zip(chunk, ranks):
            members[r].append(i)
            load[r] += counts[i]
    fewest = min(len(ms) for ms in members)

    def split(m: int) -> list[list[list[int]]] | None:
        plan = [_split_rank(ms, counts, m, mbs, cap) for ms in members]
        return None if any(p is None for p in plan) else plan  # type: ignore[return-value]

    # The fewest micro-batches the limits allow, then galloping and bisection for the
    # first count the greedy split fits: O(log n) splits of O(n log n) each, where
    # trying each count in turn took O(n) splits.
    lo = max(_fewest_microbatches(ms, counts, mbs, cap) for ms in members)
    if lo <= fewest:
        plan = split(lo)
        if plan is not None:
            return plan
        step, failed = 1, lo
        while plan is None and failed < fewest:
            m = min(failed + step, fewest)
            plan = split(m)
            if plan is None:
                failed, step = m, 2 * step
        if plan is not None:
            good = m
            while good - failed > 1:
                mid = (failed + good) // 2
                trial = split(mid)
                if trial is None:
                    failed = mid
                else:
                    good, plan = mid, trial
            return plan
    raise ValueError(
        f"the limits (micro_batch_size={mbs}, max_tokens_per_microbatch={cap}) need more micro-batches per rank "
        f"than the {fewest} samples a rank holds; raise the limits or lower dp_size"
    )


def _check_microbatches(microbatches: Any) -> list[list[int]]:
    if isinstance(microbatches, (str, bytes, Mapping)) or not isinstance(microbatches, Sequence):
        raise TypeError(f"microbatches: expected a sequence of index lists, got {type(microbatches).__name__}")
    out: list[list[int]] = []
    seen: dict[int, int] = {}
    for k, mb in enumerate(microbatches):
        ids = list(check_indices(mb, f"microbatches[{k}]", limit=MAX_SAMPLE_ID, what="sample index"))
        for i in ids:
            if i in seen:
                raise ValueError(f"microbatches[{k}]: sample {i} is also in microbatches[{seen[i]}]")
            seen[i] = k
        out.append(ids)
    return out


class ShardCollator:
    """Fetch and collate one rank's micro-batches: an iterable of the batches `ReplayHook` consumes.

    For each micro-batch (a list of global sample indices) it calls
    `fetch(indices)`, which returns that micro-batch's sample dicts in the
    same order (as `R3Collator` takes them), and yields their collated batch.
    The indices go to the collator as `sample_ids`, so with the global
    batch's `seq_len` and `dtype` (`torch_r3.global_geometry`) every micro-batch
    is bit-identical to its rows of one global `R3Collator` batch (packed: to
    its samples' spans of it). Batches come from the collator's recycled
    buffers: a `for` loop that drops each batch when it takes the next keeps
    two micro-batches' buffers alive.

    Args:
        fetch: `fetch(indices) -> samples`, called once per micro-batch and
            iteration (from a helper thread with `prefetch=True`).
        microbatches: this rank's micro-batches, each a sequence of distinct
            global sample indices (`plan_microbatches(...)[rank]`, or a
            framework's own lists).
        layout: as in `R3Collator`; for padded batches, the global batch's
            `T` as `torch_r3.Padded(seq_len=)` (`torch_r3.global_geometry`).
        memory: as in `R3Collator`; its `buffers`, a `BufferPool` shared by
            the `ShardCollator`s of successive steps (each step's plan
            differs), lets later steps reuse the memory of earlier ones; by
            default each `ShardCollator` has its own.
        prefetch: fetch the next micro-batch in a helper thread while the
            current one trains: the fetch starts once the current micro-batch
            is collated (its rows copied out of what its fetch returned, so a
            `fetch` may decode into one reused buffer), and the fetched
            samples are held, not collated, so the buffer bound stays two batches.
        **options: the other `R3Collator` settings (`dtype` (the global route
            dtype), `keep_layers` (a pipeline stage's layers), `pad_keys`,
            `filler`, `num_experts`, `pad_token_id`, ...), and the deprecated
            keywords `R3Collator` takes (`seq_len=`, `buffers=`, `layers=`,
            ...), each with a `DeprecationWarning`.

    Raises:
        TypeError: `fetch` is not callable, or a setting of the wrong kind.
        ValueError: an empty or repeated micro-batch index, a bad setting, or
            `Memory(buffers=, cache_bytes=)` (give the bound to the pool); when
            iterating, a `fetch` that returns the wrong number of samples, or a
            `pad_keys` key whose dtype differs from the first micro-batch's, or
            an other key's (its values' promotion: pass the global batch's dtype
            as `extra_dtypes={key: dtype}`, see `R3Collator`).
    """

    def __init__(
        self,
        fetch: Callable[[list[int]], Sequence[Mapping[str, Any]]],
        microbatches: Sequence[Sequence[int]],
        *,
        layout: Layout | str = "padded",
        memory: Memory | None = None,
        prefetch: bool = False,
        **options: Any,
    ) -> None:
        if not callable(fetch):
            raise TypeError(f"fetch must be callable (indices -> samples), got {type(fetch).__name__}")
        self.prefetch = check_bool(prefetch, "prefetch")
        self.fetch = fetch
        self.microbatches = _check_microbatches(microbatches)
        keep_layers = renamed_argument(
            options.pop("layers", None),
            options.pop("keep_layers", None),
            old="layers",
            new="keep_layers",
            where="ShardCollator",
        )
        filler = renamed_argument(
            options.pop("padding", None),
            options.pop("filler", "arange"),
            old="padding",
            new="filler",
            where="ShardCollator",
            default="arange",
        )
        old = {k: options.pop(k) for k in list(options) if k in LAYOUT_KEYWORDS or k in MEMORY_KEYWORDS}
        layout, memory = from_keywords("ShardCollator", layout, memory, old, keywords=LAYOUT_KEYWORDS + MEMORY_KEYWORDS)
        self.collator = R3Collator(layout=layout, memory=memory, keep_layers=keep_layers, filler=filler, **options)

    def __repr__(self) -> str:
        return f"ShardCollator({len(self.microbatches)} micro-batches, prefetch={self.prefetch}, {self.collator!r})"

    def __len__(self) -> int:
        return len(self.microbatches)

    def _fetch(self, k: int) -> Sequence[Mapping[str, Any]]:
        indices = self.microbatches[k]
        samples = self.fetch(list(indices))
        if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
            raise TypeError(f"fetch({indices}) returned {type(samples).__name__}, expected a sequence of samples")
        if len(samples) != len(indices):
            raise ValueError(f"fetch({indices}) returned {len(samples)} samples for {len(indices)} indices")
        return samples

    def _collate(self, samples: Sequence[Mapping[str, Any]], k: int, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
        batch = self.collator(samples, sample_ids=self.microbatches[k])
        # Every micro-batch of the step gets the dtype the first one set (a pad key's values can
        # promote differently in different micro-batches, which the global batch would not).
        for key in self.collator.pad_keys:
            dt = dtypes.setdefault(key, batch[key].dtype)
            if batch[key].dtype != dt:
                raise ValueError(
                    f"micro-batch {k} ({self.microbatches[k]}): {key!r} came out {batch[key].dtype}, the first "
                    f"micro-batch's {dt}; give every sample's {key!r} one dtype"
                )
        # An other key's dtype is the promotion of the micro-batch's own values, which the global batch's
        # may not be (ints here, floats elsewhere): refused unless `extra_dtypes` gives the global one.
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or key in OUTPUT_KEYS or key in self.collator.pad_keys:
                continue
            dt = dtypes.setdefault(key, value.dtype)
            if value.dtype != dt:
                raise ValueError(
                    f"micro-batch {k} ({self.microbatches[k]}): extra key {key!r} came out {value.dtype}, the "
                    f"first micro-batch's {dt}: each promotes its own samples' values; pass the global batch's "
                    f"dtype, extra_dtypes={{{key!r}: ...}} (NumPy's promotion of every sample's {key!r}), or give "
                    f"every sample's {key!r} one type"
                )
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        dtypes: dict[str, torch.dtype] = {}
        if not self.prefetch:
            for k in range(len(self.microbatches)):
                batch = self._collate(self._fetch(k), k, dtypes)
                yield batch
                del batch  # the caller's loop variable is the one reference left
            return
        # A local: when a live iterator is collected at interpreter exit, this module's globals may be gone.
        finalizing = sys.is_finalizing
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch_r3-prefetch")
        try:
            pending = pool.submit(self._fetch, 0) if self.microbatches else None
            for k in range(len(self.microbatches)):
                assert pending is not None
                samples = pending.result()
                batch = self._collate(samples, k, dtypes)
                del samples
                # Only now, with micro-batch k's rows copied out of what its fetch returned: a fetch
                # that decodes into one reused buffer must not overwrite rows still being collated.
                pending = pool.submit(self._fetch, k + 1) if k + 1 < len(self.microbatches) else None
                yield batch
                del batch
        finally:
            # At exit concurrent.futures has already stopped its threads, and its own globals
            # (which shutdown() needs) may be gone: nothing is left to shut down.
            if not finalizing():
                pool.shutdown(wait=True, cancel_futures=True)
