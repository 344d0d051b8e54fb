"""The independent reference of the engine-health checks: whole-array NumPy passes, one per question.

This is the check as torch_r3 0.2 first shipped it (before the packed-word
passes of `torch_r3.health._scan`): a full boolean `[rows, layers]` zero mask, a
layer-equals-its-first-row pass, a consecutive-rows pass, and a remembered-block
dictionary looked up once per window with a row hash of its own. It imports
nothing from `torch_r3`, so the package's findings can be compared with it
finding for finding (kind, layer, rows and the words of `seen`). Its replay
memory hashes differently from the package's; both are 64-bit, so they agree
but for a hash collision. The `num_experts` rule (skip the row-identity checks
when a layer's row is one of at most two sets) is spelled out here as the
module docs state it.
"""

from __future__ import annotations

import collections
import math

import numpy as np

_PRIME = 0x100000001B3
_PRIME_INV = pow(_PRIME, -1, 1 << 64)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _powers(base, n):
    out = np.empty(n, np.uint64)
    if n:
        out[0] = 1
        with np.errstate(over="ignore"):
            out[1:] = np.uint64(base)
            np.cumprod(out, out=out)
    return out


class ReferenceMemory:
    def __init__(self, block, max_blocks, min_token_changes):
        self.block, self.max_blocks, self.min_token_changes = block, max_blocks, min_token_changes
        self.blocks = collections.OrderedDict()

    def windows(self, routes):
        rows = routes.shape[0]
        if rows < self.block:
            return None
        ids = routes.reshape(rows, -1).astype(np.int64)
        if ids.shape[1] % 2:
            ids = np.concatenate([ids, np.zeros((rows, 1), ids.dtype)], axis=1)
        words = np.ascontiguousarray(ids, dtype="<u4").view("<u8")
        mult = np.random.default_rng(0x52335F).integers(1, 1 << 63, words.shape[1], dtype=np.uint64) * np.uint64(2)
        mult += np.uint64(1)
        with np.errstate(over="ignore"):
            h = words @ mult
            h = (h ^ (h >> np.uint64(29))) * _MIX
            prefix = np.concatenate(([np.uint64(0)], np.cumsum(h * _powers(_PRIME_INV, rows), dtype=np.uint64)))
            fwd = _powers(_PRIME, rows + self.block)
            n = rows - self.block + 1
            return (prefix[self.block : self.block + n] - prefix[:n]) * fwd[self.block - 1 : self.block - 1 + n]

    def replays(self, routes, tokens):
        windows = self.windows(routes)
        if windows is None or not self.blocks:
            return []
        out = []
        for i, h in enumerate(windows.tolist()):
            hit = self.blocks.get(h)
            if hit is None:
                continue
            old, source = hit
            changes = int(np.count_nonzero(old != tokens[i : i + self.block]))
            window = routes[i : i + self.block].reshape(self.block, -1)
            if changes < self.min_token_changes or np.unique(window, axis=0).shape[0] * 2 < self.block:
                continue
            last = i + self.block - 1
            if out and out[-1][2] == source and i <= out[-1][1] + 1:
                out[-1] = (out[-1][0], last, source, max(out[-1][3], changes))
            else:
                out.append((i, last, source, changes))
        return out

    def remember(self, routes, tokens, source):
        windows = self.windows(routes)
        if self.max_blocks == 0 or windows is None:
            return
        for start in range(0, windows.shape[0], self.block):
            if not routes[start : start + self.block].any():
                continue
            key = int(windows[start])
            self.blocks[key] = (np.array(tokens[start : start + self.block]), source)
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class ReferenceHealth:
    """`check` returns `(kind, layer, rows, seen)` tuples in the package's order; `stats` counts as it does."""

    def __init__(self, *, moe_layers=(), num_experts=None, min_rows=64, min_run=16, min_token_changes=8,
                 remember_blocks=8192):  # fmt: skip
        self.moe_layers, self.num_experts = tuple(moe_layers), num_experts
        self.min_rows, self.min_run, self.min_token_changes = min_rows, min_run, min_token_changes
        self.remember_blocks = remember_blocks
        self.memory = ReferenceMemory(min_run, remember_blocks, min_token_changes)
        self.stats = collections.Counter()

    def check(self, routes, tokens=None, name="t"):
        tokens = None if tokens is None else np.asarray(tokens, np.int64)
        topk = routes.shape[2]
        few = self.num_experts is not None and math.comb(self.num_experts, topk) in (1, 2)
        out = self._findings(routes, tokens, few)
        if tokens is not None and self.remember_blocks and not few:
            out += [
                ("replayed_rows", None, (a, b),
                 f"rows {a}..{b} repeat, in every layer and in order, rows that {src} returned, "
                 f"behind tokens that differ at {n} positions")
                for a, b, src, n in self.memory.replays(routes, tokens)
            ]  # fmt: skip
            if not out:
                self.memory.remember(routes, tokens, name)
        self.stats["trajectories"] += 1
        self.stats["rows"] += routes.shape[0]
        self.stats["uninformative"] += int(few)
        for kind, *_ in out:
            self.stats[kind] += 1
        return out

    def _findings(self, routes, tokens, few):
        rows, layers, topk = routes.shape
        if rows == 0:
            return []
        out = []
        zero = ~routes.any(axis=2)
        same = (routes == routes[:1]).all(axis=2).all(axis=0)
        varies = ~same
        changes = int(np.count_nonzero(tokens[1:] != tokens[:-1])) if tokens is not None else 0

        def apart(layer):
            others = varies if layer is None else np.delete(varies, layer)
            return changes >= self.min_token_changes or bool(others.any())

        def zero_finding(layer, mask):
            idx = np.flatnonzero(mask)
            if idx.size == 0:
                return
            if topk == 1 and (few or idx.size < max(rows, self.min_rows) or not apart(layer)):
                return
            a, b = int(idx[0]), int(idx[-1])
            span = f"rows {a}..{b} of {rows} are" if idx.size == b - a + 1 else f"{idx.size} of {rows} rows are"
            out.append(("zero_rows", layer, (a, b), f"{span} all zero"))

        if self.moe_layers:
            for layer in self.moe_layers:
                zero_finding(layer, zero[:, layer])
        else:
            zero_finding(None, zero.all(axis=1))
        if few:
            return out
        if rows >= self.min_rows:
            for layer in np.flatnonzero(same & ~zero[0]).tolist():
                if changes >= self.min_token_changes or bool(np.delete(varies, layer).any()):
                    seen = f"all {rows} rows are {routes[0, layer].tolist()} although the hidden states vary"
                    out.append(("constant_layer", layer, (0, rows - 1), seen))
        if tokens is not None and rows >= self.min_run:
            flat = routes.reshape(rows, -1)
            repeat = (flat[1:] == flat[:-1]).all(axis=1)
            moved_at = tokens[1:] != tokens[:-1]
            edges = np.flatnonzero(np.diff(np.concatenate(([False], repeat, [False])).astype(np.int8)))
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
                moved = int(np.count_nonzero(moved_at[a:b]))
                if b - a + 1 >= self.min_run and moved >= self.min_token_changes and flat[a].any():
                    out.append(
                        (
                            "stale_rows",
                            None,
                            (a, b),
                            f"rows {a}..{b} repeat one row verbatim over {moved} token changes",
                        )
                    )
        return out
