"""A bounded memory of recent responses' route-row blocks, for the health check's replayed-rows signature.

An engine that hands a request rows captured for another request (SGLang's
stale padded capture slots, sgl-project/sglang#36404: the slots a new request
reuses still hold an earlier request's rows) returns a run of rows copied
verbatim from that earlier response, behind other tokens. `RowMemory` keeps
fingerprints of aligned `block`-row blocks of the responses it has seen (a
64-bit polynomial hash of their full rows, every layer) with the tokens behind
each, at most `max_blocks` of them, oldest dropped first. `replays` looks up
every `block`-row window of a new response (one rolling hash per row, so
`O(rows * layers * topk)`), and reports the windows equal to a remembered
block whose tokens differ at `min_token_changes` positions or more. Any run of
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

__all__ = ["Replay", "RowMemory"]

_PRIME = 0x100000001B3  # odd, so it has an inverse modulo 2**64
_PRIME_INV = pow(_PRIME, -1, 1 << 64)
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Replay:
    """Rows `[first, last]` of the new response equal, in order, to rows of `source` behind other tokens."""

    first: int
    last: int
    source: str
    token_changes: int


class RowMemory:
    """Fingerprints of the last `max_blocks` aligned `block`-row blocks seen (see the module docstring)."""

    def __init__(self, block: int, max_blocks: int, min_token_changes: int) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self.min_token_changes = min_token_changes
        self._blocks: collections.OrderedDict[int, tuple[np.ndarray, str]] = collections.OrderedDict()
        self._multipliers: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        # A copy starts empty: the fingerprints are a cache of recent responses, megabytes that a client
        # pickled into a worker or an actor need not carry along.
        return (RowMemory, (self.block, self.max_blocks, self.min_token_changes))

    def clear(self) -> None:
        """Forget every response."""
        self._blocks.clear()

    def replays(self, routes: np.ndarray, tokens: np.ndarray) -> list[Replay]:
        """The runs of `routes` (behind `tokens`) that repeat a remembered block, merged; the memory is unchanged."""
        windows = self._window_hashes(routes)
        if windows is None or not self._blocks:
            return []
        out: list[Replay] = []
        for i, h in enumerate(windows.tolist()):
            hit = self._blocks.get(h)
            if hit is None:
                continue
            old_tokens, source = hit
            changes = int(np.count_nonzero(old_tokens != tokens[i : i + self.block]))
            if changes < self.min_token_changes or not _distinct_enough(routes[i : i + self.block]):
                continue
            last = i + self.block - 1
            if out and out[-1].source == source and i <= out[-1].last + 1:
                prev = out[-1]
                out[-1] = Replay(prev.first, last, source, max(prev.token_changes, changes))
            else:
                out.append(Replay(i, last, source, changes))
        return out

    def remember(self, routes: np.ndarray, tokens: np.ndarray, source: str) -> None:
        """Keep the aligned blocks of `routes` (all-zero blocks, the zero-rows check's, are skipped)."""
        if self.max_blocks == 0:
            return
        windows = self._window_hashes(routes)
        if windows is None:
            return
        for start in range(0, windows.shape[0], self.block):
            if not routes[start : start + self.block].any():
                continue
            key = int(windows[start])
            self._blocks[key] = (np.array(tokens[start : start + self.block]), source)
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def _window_hashes(self, routes: np.ndarray) -> np.ndarray | None:
        """The hash of rows `[i, i + block)` for every `i` (`None`: fewer rows than a block)."""
        rows = routes.shape[0]
        if rows < self.block:
            return None
        # The ids as uint32 whatever the dtype (one row hashes alike in a uint8 and an int16 response),
        # read two at a time as uint64 words.
        ids = routes.reshape(rows, -1)
        if ids.shape[1] % 2:
            ids = np.concatenate([ids, np.zeros((rows, 1), ids.dtype)], axis=1)
        words = np.ascontiguousarray(ids, dtype="<u4").view("<u8")
        width = words.shape[1]
        if self._multipliers is None or self._multipliers.shape[0] != width:
            rng = np.random.default_rng(0x52335F)  # fixed: hashes must agree across calls
            self._multipliers = rng.integers(1, 1 << 63, width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        with np.errstate(over="ignore"):
            # Per row: a random linear combination of its words, then a mixing multiply.
            h = words @ self._multipliers
            h = (h ^ (h >> np.uint64(29))) * _MIX
            # Window hash: sum_j h[i + j] * P**(block - 1 - j), from prefix sums of h[j] * P**-j.
            inv = _powers(_PRIME_INV, rows)
            prefix = np.concatenate(([np.uint64(0)], np.cumsum(h * inv, dtype=np.uint64)))
            fwd = _powers(_PRIME, rows + self.block)
            n = rows - self.block + 1
            return (prefix[self.block : self.block + n] - prefix[:n]) * fwd[self.block - 1 : self.block - 1 + n]


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
