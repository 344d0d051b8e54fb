"""Checks of a batch's routes at the boundary, before any router of a `transformers` model uses them.

* `check_batch`: keys, dtypes and shapes of the dict (padded `[B, T, L, K]` with
  `router_padding_mask [B, T]`, or packed `[N, L, K]` with `cu_seqlens`);
* `layer_columns`: which column of `L` each router reads (every decoder layer,
  or the MoE layers only);
* `check_expert_ids`: every route that will be replayed holds `K` distinct ids
  in `[0, num_experts)`, one vectorised pass and one host sync, with the first
  bad position named;
* `check_router_tokens`: at the router call, one route per token it sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_r3._route_checks import bad_route_message, check_route_tensors, first_bad_route, route_position
from torch_r3.keys import CU_SEQLENS, ROUTER_MASK, ROUTES

# Internals of the hook, shared with `hook.py` under plain names: nothing here is public.
__all__: list[str] = []


def check_batch(batch: Any, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check the route keys of a batch; the packed layout comes back as one row (`B = 1`).

    Args:
        batch: The dict `R3Collator` (or `collate_routes`) produced.
        topk: The model's experts per token.

    Returns:
        `(routes [B, T, L, K], router_padding_mask [B, T], cu_seqlens or None)`.

    Raises:
        TypeError: When `batch` is no mapping or a tensor has the wrong type.
        ValueError: When a key is missing or a shape is wrong.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a dict from R3Collator, got {type(batch).__name__}")
    for key in (ROUTES, ROUTER_MASK):
        if key not in batch:
            raise ValueError(f"batch: missing key {key!r}")
    routes, mask = batch[ROUTES], batch[ROUTER_MASK]
    check_route_tensors(routes, mask)
    cu_seqlens = batch.get(CU_SEQLENS)
    if cu_seqlens is not None:
        if routes.ndim != 3 or routes.shape[-1] != topk:
            raise ValueError(f"{ROUTES}: the packed layout expects [sum(n), L, K={topk}], got {list(routes.shape)}")
        if mask.shape != routes.shape[:1]:
            raise ValueError(f"{ROUTER_MASK}: the packed layout expects [{routes.shape[0]}], got {list(mask.shape)}")
        return routes.unsqueeze(0), mask.unsqueeze(0), cu_seqlens
    if routes.ndim != 4 or routes.shape[-1] != topk:
        raise ValueError(
            f"{ROUTES}: expected [B, T, L, K={topk}] (or [sum(n), L, K] with {CU_SEQLENS!r}), got {list(routes.shape)}"
        )
    if mask.shape != routes.shape[:2]:
        raise ValueError(f"{ROUTER_MASK}: expected [B, T] = {list(routes.shape[:2])}, got {list(mask.shape)}")
    return routes, mask, None


def layer_columns(layers: Sequence[int], routes_layers: int, num_layers: int) -> list[int]:
    """The column of the routes' `L` dimension that each MoE layer reads.

    Inference engines send either every decoder layer (`L == num_layers`, dense
    layers as filler rows) or the MoE layers only (`L == len(layers)`, in layer
    order); `L` tells them apart.

    Args:
        layers: The decoder layer (0-based) of each router, in model order.
        routes_layers: `L`.
        num_layers: The model's decoder layers.

    Raises:
        ValueError: When `L` is neither count.

    Examples:
        >>> layer_columns([1, 2], 3, 3), layer_columns([1, 2], 2, 3)
        ([1, 2], [0, 1])
    """
    if routes_layers == num_layers:
        return list(layers)
    if routes_layers == len(layers):
        return list(range(len(layers)))
    raise ValueError(
        f"{ROUTES} has {routes_layers} layers; expected the model's {num_layers} decoder layers "
        f"or its {len(layers)} MoE layers ({list(layers)})"
    )


def check_expert_ids(
    routes: torch.Tensor,
    checked: torch.Tensor,
    layers: Sequence[int],
    num_experts: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Every checked route holds `K` distinct expert ids in `[0, num_experts)`.

    Args:
        routes: `[B, T, M, K]`, the columns of the `M` MoE layers, any integer dtype.
        checked: `[B, T]` bool, True where the route will be replayed.
        layers: The decoder layer of each of the `M` columns, for the message.
        num_experts: The routers' expert count.
        cu_seqlens: The packed layout's offsets (then `B == 1`), for the message.

    Raises:
        ValueError: At the first bad route in batch order, naming the layer, the
            position and the value.

    Examples:
        >>> routes = torch.tensor([[[[0, 1]], [[2, 2]]]])  # B=1, T=2, one layer, K=2
        >>> check_expert_ids(routes, torch.tensor([[True, False]]), [3], 4)
        >>> check_expert_ids(routes, torch.tensor([[True, True]]), [3], 4)
        Traceback (most recent call last):
        ...
        ValueError: layer 3: row 0, token 1: expert id 2 twice in one route [2, 2]; the K=2 experts of a token must be distinct
    """
    found = first_bad_route(routes, checked, num_experts)  # the one host sync of a clean batch
    if found is None:
        return
    b, t, j, route = found
    message = bad_route_message(route, num_experts, experts=f"{num_experts} experts")
    raise ValueError(f"layer {layers[j]}: {route_position(b, t, cu_seqlens)}: {message}")


def check_router_tokens(tokens: int, rows: int, positions: int, *, layer: int) -> None:
    """At the router call: the router sees exactly one token per route.

    Args:
        tokens: Rows of the router's input.
        rows: `B`, the batch's rows.
        positions: `T`, the batch's positions per row.
        layer: The router's decoder layer.

    Raises:
        ValueError: When the counts differ.

    Examples:
        >>> check_router_tokens(6, 2, 3, layer=0)
        >>> check_router_tokens(8, 2, 3, layer=1)
        Traceback (most recent call last):
        ...
        ValueError: layer 1: the router sees 8 tokens, the batch's routes cover 6 (2 rows x 3 positions); pass the input_ids the routes were collated with
    """
    if tokens != rows * positions:
        raise ValueError(
            f"layer {layer}: the router sees {tokens} tokens, the batch's routes cover {rows * positions} "
            f"({rows} rows x {positions} positions); pass the input_ids the routes were collated with"
        )
