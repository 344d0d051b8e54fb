"""An independent reference that forces the experts: the family's own forward with `torch.topk` overridden.

Every supported router picks its experts with one `torch.topk(x, k=top_k)` call
over all `num_experts` experts (DeepSeek-V3 and GLM-4.5 also call it over the
groups, with `k=topk_group`, which is left alone). While `forced_topk` is
active, that call returns the forced experts of the next MoE layer (or its own
choice where `keep_own` is True), with the values of `x` at them; the family's
own code then weights the choice. No part of `torch_r3` takes part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def forced_topk(
    num_experts: int, top_k: int, forced: Sequence[torch.Tensor], keep_own: torch.Tensor | None = None
) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Force `forced[i]` (`[N, K]`) as the choice of the i-th router call.

    Yields `(used, own)`: per router call, the experts it used and its own top-k.
    """
    original = torch.topk
    pending = list(forced)
    used: list[torch.Tensor] = []
    owns: list[torch.Tensor] = []

    def topk(input, k, dim=-1, largest=True, sorted=True, **kwargs):
        if input.ndim == 2 and input.shape[-1] == num_experts and k == top_k and dim in (-1, 1):
            own = original(input, k, dim=dim, largest=largest, sorted=sorted).indices
            owns.append(own)
            experts = pending.pop(0)
            if keep_own is not None:
                experts = torch.where(keep_own.unsqueeze(-1), own, experts)
            used.append(experts)
            return input.gather(-1, experts), experts
        return original(input, k, dim=dim, largest=largest, sorted=sorted, **kwargs)

    torch.topk = topk
    try:
        yield used, owns
    finally:
        torch.topk = original
    assert not pending, f"{len(pending)} forced layers were never routed"
