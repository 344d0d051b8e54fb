"""`Recording`: the routes a replay hook recorded from the model's own routers (R2).

For inference engines that return no routes, a hook records what the routers
chose in the old-log-prob forward pass and replays it in the update. Both hooks
hand the result back as a `Recording`: one batch-layout dict per microbatch.
"""

from __future__ import annotations

import torch

__all__ = ["Recording"]


class Recording:
    """The routes one recording pass produced: the model's own choice, in the collated batch layout.

    Attributes:
        microbatches: One dict per microbatch, in order, each holding
            `rollout_expert_indices` (`[B, T, L, K]`, or `[N, L, K]` for the
            packed layout) and `router_padding_mask`; empty until the pass ends.
            Hand each (with its tokens) to the hook's replay in the update.

    Examples:
        >>> rec = Recording()
        >>> rec.batch
        {}
        >>> rec.microbatches.append({"router_padding_mask": torch.zeros(1, 2, dtype=torch.bool)})
        >>> list(rec.batch)
        ['router_padding_mask']
    """

    def __init__(self, microbatches: list[dict[str, torch.Tensor]] | None = None) -> None:
        self.microbatches: list[dict[str, torch.Tensor]] = [] if microbatches is None else microbatches

    @property
    def batch(self) -> dict[str, torch.Tensor]:
        """The one microbatch's dict (a `transformers` forward); `{}` before the pass ends.

        Raises:
            ValueError: When the pass recorded more than one microbatch (read `microbatches`).
        """
        if not self.microbatches:
            return {}
        if len(self.microbatches) > 1:
            raise ValueError(
                f"Recording.batch: {len(self.microbatches)} microbatches were recorded; read .microbatches"
            )
        return self.microbatches[0]

    def __repr__(self) -> str:
        return f"Recording({len(self.microbatches)} microbatches)"
