"""A bounded memory of recent responses' route-row blocks, for the health check's replayed-rows signature.

An engine that hands a request rows captured for another request (SGLang's
stale padded capture slots, sgl-project/sglang#36404: the slots a new request
reuses still hold an earlier request's rows) returns a run of rows copied
verbatim from that earlier response, behind other tokens. `RowMemory` keeps
fingerprints of aligned `block`-row blocks of the responses it has seen (a
64-bit polynomial hash of their full rows' hashes, every layer; the row hash,
`RouteScan.row_hashes`, is multilinear over 32-bit halves, so rows that differ
in any structured way collide for about one pair in 2**32) with the tokens behind
each, at most `max_blocks` of them, oldest dropped first. `replays` looks up
every `block`-row window of a new response (a rolling hash over the row
hashes of `torch_r3.health._scan`, so `O(rows)` after one pass over the ids),
and reports the windows equal to a remembered block whose tokens differ at
`min_token_changes` positions or more. The window hashes are screened in one
vectorised gather against a counting filter of the remembered keys (a table of
counts indexed by a key's top bits), so only the few windows whose slot is
occupied are looked up in the dictionary; the tokens behind the blocks live in
one array of `max_blocks` rows, grown as needed. Any run of
`2 * block - 1` replayed rows holds an aligned block of the earlier response,
so it is found wherever it sits in either response.

Identical tokens are never a replay: a prefix-cached prompt replays the very
rows its cached blocks were computed with, and a retried or resent request
gets its own rows again; both are healthy. NumPy only; no rows are kept, only
their hashes and the tokens behind them. A pickled memory unpickles empty.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

__all__ = ["Replay", "RowMemory", "window_hashes"]

_PRIME = 0x100000001B3  # odd, so it has an inverse modulo 2**64
_PRIME_INV = pow(_PRIME, -1, 1 << 64)
# The counting filter: about 32 slots per remembered block (a window whose slot is empty is no hit), 2**12 to 2**22.
_SLOTS_PER_BLOCK = 32
_MIN_BITS, _MAX_BITS = 12, 22


@dataclass(frozen=True)
class Replay:
    """Rows `[first, last]` of the new response equal, in order, to rows of `source` behind other tokens."""

    first: int
    last: int
    source: str
    token_changes: int


def window_hashes(row_hashes: np.ndarray, block: int) -> np.ndarray | None:
    """The hash of rows `[i, i + block)` for every `i`, from per-row hashes (`None`: fewer rows than a block)."""
    rows = row_hashes.shape[0]
    if rows < block:
        return None
    with np.errstate(over="ignore"):
        # Window hash: sum_j h[i + j] * P**(block - 1 - j), from prefix sums of h[j] * P**-j.
        inv = _powers(_PRIME_INV, rows)
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(row_hashes * inv, dtype=np.uint64)))
        fwd = _powers(_PRIME, rows + block)
        n = rows - block + 1
        return (prefix[block : block + n] - prefix[:n]) * fwd[block - 1 : block - 1 + n]


class RowMemory:
    """Fingerprints of the last `max_blocks` aligned `block`-row blocks seen (see the module docstring)."""

    def __init__(self, block: int, max_blocks: int, min_token_changes: int) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self.min_token_changes = min_token_changes
        # key -> (row of the token store, source), oldest first.
        self._blocks: collections.OrderedDict[int, tuple[int, str]] = collections.OrderedDict()
        self._bits = min(max(int(max_blocks * _SLOTS_PER_BLOCK).bit_length(), _MIN_BITS), _MAX_BITS)
        self._counts: np.ndarray | None = None  # uint32 [2**bits]: remembered keys per slot
        self._tokens: np.ndarray | None = None  # int64 [capacity, block]: the tokens behind each block
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        # A copy starts empty: the fingerprints are a cache of recent responses, megabytes that a client
        # pickled into a worker or an actor need not carry along.
        return (RowMemory, (self.block, self.max_blocks, self.min_token_changes))

    def clear(self) -> None:
        """Forget every response."""
        self._blocks.clear()
        self._counts = None
        self._tokens = None
        self._free = []

    def replays(self, windows: np.ndarray | None, routes: np.ndarray, tokens: np.ndarray) -> list[Replay]:
        """The runs of `routes` (behind `tokens`, int64) that repeat a remembered block, merged; nothing changes.

        `windows` is `window_hashes` of the routes' row hashes.
        """
        if windows is None or not self._blocks or self._counts is None or self._tokens is None:
            return []
        candidates = np.flatnonzero(self._counts[self._slots(windows)])
        out: list[Replay] = []
        for i, key in zip(candidates.tolist(), windows[candidates].tolist()):
            hit = self._blocks.get(key)
            if hit is None:
                continue
            row, source = hit
            changes = int(np.count_nonzero(self._tokens[row] != tokens[i : i + self.block]))
            if changes < self.min_token_changes or not _distinct_enough(routes[i : i + self.block]):
                continue
            last = i + self.block - 1
            if out and out[-1].source == source and i <= out[-1].last + 1:
                prev = out[-1]
                out[-1] = Replay(prev.first, last, source, max(prev.token_changes, changes))
            else:
                out.append(Replay(i, last, source, changes))
        return out

    def remember(self, windows: np.ndarray | None, zero_rows: np.ndarray, tokens: np.ndarray, source: str) -> None:
        """Keep the aligned blocks of a response (all-zero blocks, the zero-rows check's, are skipped).

        The same as remembering each block in order, a key seen again moving to the newest end,
        then dropping the oldest beyond `max_blocks`.
        """
        if self.max_blocks == 0 or windows is None:
            return
        count = (windows.shape[0] - 1) // self.block + 1
        starts = np.arange(count) * self.block
        keep = ~zero_rows[: count * self.block].reshape(count, self.block).all(axis=1)
        keys: list[int] = windows[starts[keep]].tolist()
        if not keys:
            return
        blocks = tokens[: count * self.block].reshape(count, self.block)[keep]
        if len(set(keys)) != len(keys):  # a key seen twice in one response: its last block, in its last place
            last = sorted({k: i for i, k in enumerate(keys)}.values())
            keys, blocks = [keys[i] for i in last], blocks[last]
        d, free = self._blocks, self._free
        removed = [k for k in keys if k in d]  # remembered before: moves to the newest end, keeps its store row
        rows: list[int | None] = [None] * len(keys)
        if removed:
            kept = {k: d.pop(k)[0] for k in removed}
            rows = [kept.get(k) for k in keys]
        if len(keys) > self.max_blocks:  # the oldest of this response's own blocks drop out too
            cut = len(keys) - self.max_blocks
            free.extend(r for r in rows[:cut] if r is not None)
            keys, rows, blocks = keys[cut:], rows[cut:], blocks[cut:]
        overflow = len(d) + len(keys) - self.max_blocks
        if overflow > 0:
            evicted = [d.popitem(last=False) for _ in range(overflow)]
            removed.extend(k for k, _ in evicted)
            free.extend(v[0] for _, v in evicted)
        needed = rows.count(None)
        store = self._store(needed)
        new_rows = free[len(free) - needed :]
        del free[len(free) - needed :]
        if needed == len(rows):
            final: list[int] = new_rows
        else:
            fresh = iter(new_rows)
            final = [r if r is not None else next(fresh) for r in rows]
        store[final] = blocks
        d.update(zip(keys, [(r, source) for r in final]))
        counts = self._counts
        if counts is None:
            counts = self._counts = np.zeros(1 << self._bits, np.uint32)
        one = np.uint32(1)  # of the table's dtype: NumPy's fast path for `ufunc.at`
        if removed:
            np.subtract.at(counts, self._slots(np.array(removed, np.uint64)), one)
        np.add.at(counts, self._slots(np.array(keys, np.uint64)), one)

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> np.uint64(64 - self._bits)).astype(np.intp)

    def _store(self, needed: int) -> np.ndarray:
        """The token store, with at least `needed` free rows (grown by doubling, never past `max_blocks`)."""
        store = self._tokens
        used = 0 if store is None else store.shape[0]
        if needed > len(self._free):
            size = min(max(2 * used, needed - len(self._free) + used, 64), self.max_blocks)
            grown = np.zeros((size, self.block), np.int64)
            if store is not None:
                grown[:used] = store
            self._free.extend(range(size - 1, used - 1, -1))
            self._tokens = store = grown
        assert store is not None
        return store


def _powers(base: int, n: int) -> np.ndarray:
    """`base**j mod 2**64` for `j < n`."""
    out = np.empty(n, np.uint64)
    if n:
        out[0] = 1
        with np.errstate(over="ignore"):
            out[1:] = np.uint64(base)
            np.cumprod(out, out=out)
    return out


def _distinct_enough(window: np.ndarray) -> bool:
    """At least half the window's rows distinct: a constant or near-constant run is the other checks' signature."""
    flat = np.ascontiguousarray(window).reshape(window.shape[0], -1)
    return np.unique(flat, axis=0).shape[0] * 2 >= window.shape[0]
