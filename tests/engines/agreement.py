"""Engine routes against the reference forward, with a running tally (`tests.engines.agreement`).

`Agreement.check(routes, tokens, model, start=...)` asserts the alignment rule and the routes:
row `j` of `routes` is the forward that took token `start + j` of `tokens` (prompt + generated)
as input, so there are `len(tokens) - 1 - start` rows (the last generated token is never run
forward), and each row's experts, per layer, are the reference router top-k as a set
(`checkpoints.reference_routes` over the same tokens and weights). The tally (requests, rows,
(row, layer) pairs, rows that came in descending-logit order, the smallest k-th/(k+1)-th gap)
is printed at the end of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.engines.checkpoints import router_logits, sorted_rows, top_k

__all__ = ["Agreement"]


@dataclass
class Agreement:
    """Counts what was compared; `check` raises `AssertionError` at the first disagreement."""

    requests: int = 0
    rows: int = 0
    pairs: int = 0
    unordered_pairs: int = 0  # (row, layer) pairs whose order was not descending router logit
    min_gap: float = float("inf")

    def check(self, routes: Any, tokens: Any, model: torch.nn.Module, *, start: int = 0, what: str = "") -> None:
        tokens = [int(t) for t in tokens]
        routes = np.asarray(routes)
        assert routes.ndim == 3, f"{what}: routes of shape {routes.shape}"
        assert routes.shape[0] == len(tokens) - 1 - start, (
            f"{what}: {routes.shape[0]} rows for {len(tokens)} tokens from position {start}: "
            f"expected {len(tokens) - 1 - start} (row j = token start + j; the last token has no row)"
        )
        logits = router_logits(model, tokens[: len(tokens) - 1])[start:]  # [rows, L, E]
        ref, gap = top_k(logits, routes.shape[2])
        got = sorted_rows(routes)
        assert got.shape == ref.shape, f"{what}: routes {got.shape}, reference {ref.shape}"
        bad = np.argwhere((got != ref).any(-1))
        if len(bad):
            j, layer = (int(x) for x in bad[0])
            raise AssertionError(
                f"{what}: {len(bad)} of {got.shape[0] * got.shape[1]} (row, layer) pairs differ from the reference; "
                f"first: row {j} (token {start + j}), layer {layer}: engine {routes[j, layer].tolist()}, "
                f"reference {ref[j, layer].tolist()}"
            )
        self.requests += 1
        self.rows += got.shape[0]
        self.pairs += got.shape[0] * got.shape[1]
        picked = np.take_along_axis(logits, routes.astype(np.int64), axis=-1)
        self.unordered_pairs += int((np.diff(picked, axis=-1) > 0).any(-1).sum())
        self.min_gap = min(self.min_gap, gap)

    def summary(self) -> str:
        return (
            f"engine routes vs transformers fp32 router top-k (as sets): {self.requests} requests, "
            f"{self.rows}/{self.rows} rows, {self.pairs}/{self.pairs} (row, layer) pairs agreed; "
            f"{self.unordered_pairs} of {self.pairs} pairs not in descending-logit order; "
            f"closest k-th/(k+1)-th logit gap {self.min_gap:.3g}"
        )
