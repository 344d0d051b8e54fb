"""The checks both replay hooks make on a batch's route tensors, with no training framework imported.

The Megatron hook and the `transformers` hook receive the same `R3Collator`
batch and refuse the same mistakes, so the rules live here once:

* `check_route_tensors`: `rollout_expert_indices` is an integer tensor of a
  route dtype and `router_padding_mask` a bool tensor (`TypeError` otherwise);
* `first_bad_route`: the first replayed route whose `K` ids are not distinct
  ids in `[0, num_experts)`, found with whole-tensor reductions and one host
  sync when the batch is clean (a bad id that reaches a router fails deep in
  `gather`, or on a GPU kills the CUDA context; a duplicate trains silently
  on the wrong experts);
* `bad_route_message`: what is wrong with that route, in one wording;
* `route_position`: where it is (row and token, or sequence and token in the
  packed layout).

Each hook adds its own prefix (microbatch, layer) and its own name for the
expert count.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_r3.keys import ROUTER_MASK, ROUTES

__all__: list[str] = []

ROUTE_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
"""The torch dtypes a batch's routes may have (what `R3Collator` produces, and int64)."""


def check_route_tensors(routes: Any, mask: Any) -> None:
    """`routes` a tensor of a route dtype and `mask` a bool tensor; a `TypeError` naming the key otherwise."""
    if not isinstance(routes, torch.Tensor) or routes.dtype not in ROUTE_DTYPES:
        what = routes.dtype if isinstance(routes, torch.Tensor) else type(routes).__name__
        raise TypeError(f"{ROUTES}: expected a uint8/int16/int32/int64 torch.Tensor, got {what}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{ROUTER_MASK}: expected a torch.bool tensor, got {what}")


def _fits(view: torch.Tensor, num_experts: int) -> bool:
    # Compare with scalars the dtype can hold: `uint8 >= 256` would wrap 256 to 0.
    return num_experts <= torch.iinfo(view.dtype).max


def _any_bad(view: torch.Tensor, num_experts: int) -> bool:
    """Fast path over the whole tensor: any id out of range or repeated in a route, anywhere?

    Whole-tensor reductions, no per-row masks (reducing over a short last
    dimension is several times slower); K - 1 shifted comparisons find a repeated
    id without sorting.
    """
    flags = [view.max() >= num_experts] if _fits(view, num_experts) else []
    if view.dtype.is_signed:  # uint8 routes cannot be negative
        flags.append(view.min() < 0)
    flags += [(view[..., shift:] == view[..., :-shift]).any() for shift in range(1, view.shape[-1])]
    return bool(torch.stack(flags).any()) if flags else False


def _bad_rows(view: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per route `[B, T, L]`: out of range or repeated (only run when `_any_bad` found something)."""
    bad = torch.zeros(view.shape[:-1], dtype=torch.bool, device=view.device)
    if _fits(view, num_experts):
        bad |= (view >= num_experts).any(-1)
    if view.dtype.is_signed:
        bad |= (view < 0).any(-1)
    for shift in range(1, view.shape[-1]):
        bad |= (view[..., shift:] == view[..., :-shift]).any(-1)
    return bad


def first_bad_route(
    view: torch.Tensor, checked: torch.Tensor, num_experts: int
) -> tuple[int, int, int, list[int]] | None:
    """`(b, t, j, route)` of the first bad route in batch order among the `checked` positions, or `None`.

    Args:
        view: `[B, T, L, K]` routes, any integer dtype, the columns to check only.
        checked: `[B, T]` bool, `True` where the route will be replayed
            (filler rows that are never replayed may hold anything).
        num_experts: The routers' expert count.

    Examples:
        >>> routes = torch.tensor([[[[0, 1]], [[2, 2]]]])  # B=1, T=2, L=1, K=2
        >>> first_bad_route(routes, torch.tensor([[True, False]]), 8) is None
        True
        >>> first_bad_route(routes, torch.tensor([[True, True]]), 8)
        (0, 1, 0, [2, 2])
    """
    if not _any_bad(view, num_experts):  # the one host sync of a clean batch
        return None
    bad_row = _bad_rows(view, num_experts) & checked.to(view.device).unsqueeze(-1)
    if not bool(bad_row.any()):
        return None
    b, t, j = (int(x) for x in bad_row.nonzero()[0])
    return b, t, j, view[b, t, j].tolist()


def bad_route_message(route: list[int], num_experts: int, *, experts: str) -> str:
    """What is wrong with a route `first_bad_route` found; `experts` says the count as the model names it.

    Examples:
        >>> bad_route_message([2, 9], 8, experts="8 experts")
        'expert id 9 outside [0, 8) in route [2, 9] (the model has 8 experts)'
    """
    outside = [e for e in route if not 0 <= e < num_experts]
    if outside:
        return f"expert id {outside[0]} outside [0, {num_experts}) in route {route} (the model has {experts})"
    twice = next(e for e in route if route.count(e) > 1)
    return f"expert id {twice} twice in one route {route}; the K={len(route)} experts of a token must be distinct"


def route_position(b: int, t: int, cu_seqlens: torch.Tensor | None) -> str:
    """A position as the batch's layout names it: row and token, or (packed, `b == 0`) sequence and token."""
    if cu_seqlens is None:
        return f"row {b}, token {t}"
    bounds = cu_seqlens.tolist()
    seq = max(i for i, start in enumerate(bounds[:-1]) if start <= t)
    return f"sequence {seq}, token {t - bounds[seq]}"
