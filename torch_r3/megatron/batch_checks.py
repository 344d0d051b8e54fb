"""Checks of a microbatch's routes before any router uses them.

Three checks, each raising with the microbatch, the global layer and the first
offending position, so that a bad route never reaches Megatron (where an id out
of range fails deep inside `scores.gather`, or on a GPU kills the CUDA context,
and a duplicate or a missing row trains silently on the wrong experts):

* `check_route_values`: every replayed route holds K distinct expert ids in
  `[0, num_moe_experts)` (the rule of `torch_r3.replay.checks`, which also
  checks the dict's keys, dtypes and shapes), with Megatron's names;
* `check_model_input` and `check_router_rows`: the routes cover exactly the
  tokens the model (first stage) and each router (every stage) sees;
* `model_padding_mask`, `check_record_microbatch`: the padding mask Megatron
  gets, and the token layout of a microbatch to record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS, CU_SEQLENS_PADDED, INPUT_IDS
from torch_r3.replay.checks import check_input_shape, check_replayed_ids, check_router_tokens
from torch_r3.replay.padding import alignment_padding, checked_attention_mask

# The other checks are the hook's internals, shared with `hook.py` under plain names.
__all__ = ["check_route_values"]


def check_aligned_offsets(batch: Mapping, cu_seqlens: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """A packed batch's `cu_seqlens_padded` (per-sequence alignment), checked against `cu_seqlens`; else `None`.

    Sequence `i` holds rows `[cu_seqlens_padded[i], cu_seqlens_padded[i] + n_i)`
    of the packed tensors, `n_i` from `cu_seqlens`, then its alignment rows; the
    aligned offsets are what the context-parallel split and the routers follow.

    Raises:
        TypeError: When it is no integer tensor.
        ValueError: When it comes without `cu_seqlens`, has another length, does
            not cover the `rows` of the routes, or a sequence's real tokens exceed its span.
    """
    aligned = batch.get(CU_SEQLENS_PADDED)
    if aligned is None:
        return None
    if cu_seqlens is None:
        raise ValueError(f"microbatch: {CU_SEQLENS_PADDED!r} without {CU_SEQLENS!r} (the real sequence lengths)")
    if not isinstance(aligned, torch.Tensor) or aligned.dtype.is_floating_point or aligned.dtype == torch.bool:
        what = aligned.dtype if isinstance(aligned, torch.Tensor) else type(aligned).__name__
        raise TypeError(f"{CU_SEQLENS_PADDED}: expected an integer torch.Tensor [B + 1], got {what}")
    spans, real = aligned.tolist(), cu_seqlens.tolist()
    if aligned.ndim != 1 or len(spans) != len(real):
        raise ValueError(
            f"{CU_SEQLENS_PADDED}: expected shape [{len(real)}] like {CU_SEQLENS}, got {list(aligned.shape)}"
        )
    if spans[0] != 0 or spans[-1] != rows:
        raise ValueError(f"{CU_SEQLENS_PADDED}: expected offsets from 0 to the routes' {rows} rows, got {spans}")
    for i in range(len(spans) - 1):
        n, span = real[i + 1] - real[i], spans[i + 1] - spans[i]
        if not 0 <= n <= span:
            raise ValueError(
                f"{CU_SEQLENS_PADDED}: sequence {i} has {n} real tokens ({CU_SEQLENS}) in an aligned span of {span}"
            )
    return aligned


def model_padding_mask(
    batch: Mapping,
    uncaptured: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    microbatch: int,
    layer: int,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> torch.Tensor:
    """The padding mask Megatron gets: `True` only where there is no real token.

    `router_padding_mask` also marks real tokens without a captured route (the
    last sampled token, a synthetic EOS); they carry loss, so aux-loss, z-loss and
    expert-bias token counts must include them. The padded layout's
    `attention_mask` (0 = padding) says which positions are padding; without it,
    padding is the leading run of uncaptured positions of each row (left
    padding). The packed layout has no padding, except, with per-sequence
    alignment (`cu_seqlens_padded`), each sequence's alignment rows.

    Args:
        batch: The microbatch dict.
        uncaptured: Its `router_padding_mask`, already on the model's device.
        cu_seqlens: The packed layout's offsets, or `None`.
        microbatch: Index of the microbatch in the step, for the message.
        layer: The stage's first MoE layer (global, 0-based), for the message.
        cu_seqlens_padded: The aligned packed layout's offsets (`check_aligned_offsets`), or `None`.

    Returns:
        A bool tensor shaped like `uncaptured`, on its device.

    Raises:
        TypeError: When `attention_mask` is not an integer or bool tensor.
        ValueError: When its shape differs from `router_padding_mask`'s (the
            routes do not cover the tokens), naming the first token without a route.
    """
    if cu_seqlens is not None:
        return alignment_padding(uncaptured, cu_seqlens, cu_seqlens_padded)
    attention = checked_attention_mask(batch)
    if attention is None:
        return (~uncaptured).cumsum(1) == 0
    check_model_input(uncaptured.shape, attention.shape, microbatch=microbatch, layer=layer, name=ATTENTION_MASK)
    return attention.to(uncaptured.device, non_blocking=True) == 0


def check_record_microbatch(batch: Any) -> tuple[tuple[int, int], torch.Tensor | None]:
    """The token layout of a microbatch whose routes are to be recorded (R2): `(B, T)` and `cu_seqlens`.

    Read from `attention_mask` `[B, T]` (or `input_ids` `[B, T]`) in the padded
    layout, and from `cu_seqlens` in the packed one (`B = 1`, `T = cu_seqlens[-1]`;
    `cu_seqlens_padded[-1]` with per-sequence alignment).

    Raises:
        TypeError: When the batch is no mapping.
        ValueError: When it holds none of those keys, or they have the wrong rank.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"microbatch: expected a dict, got {type(batch).__name__}")
    cu_seqlens = batch.get(CU_SEQLENS)
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"{CU_SEQLENS}: expected a [B + 1] tensor")
        aligned = batch.get(CU_SEQLENS_PADDED)
        if isinstance(aligned, torch.Tensor) and aligned.ndim == 1 and aligned.numel() >= 1:
            return (1, int(aligned[-1])), cu_seqlens  # checked by check_aligned_offsets
        return (1, int(cu_seqlens[-1])), cu_seqlens
    for key in (ATTENTION_MASK, INPUT_IDS):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            if value.ndim != 2:
                raise ValueError(f"{key}: expected [B, T] to record routes, got {list(value.shape)}")
            return (value.shape[0], value.shape[1]), None
    raise ValueError(
        f"microbatch: recording routes needs {ATTENTION_MASK!r} or {INPUT_IDS!r} [B, T], or {CU_SEQLENS!r}"
    )


def check_route_values(
    routes: torch.Tensor,
    checked: torch.Tensor,
    layers: Sequence[tuple[int, int]],
    num_experts: int,
    *,
    microbatch: int,
    cu_seqlens: torch.Tensor | None = None,
    uncaptured: torch.Tensor | None = None,
) -> None:
    """Every checked route holds K distinct expert ids in `[0, num_experts)`.

    Args:
        routes: `[B, T, L, K]`, or `[N, L, K]` with `cu_seqlens`; any integer dtype.
        checked: `[B, T]` (`[N]`) bool, `True` for the positions whose routes will be replayed.
        layers: `(global layer, index into L)` for each router that will use the routes.
        num_experts: The model's `num_moe_experts`.
        microbatch: Index of the microbatch in the step, for the message.
        cu_seqlens: The packed layout's sequence offsets, for the message.
        uncaptured: `router_padding_mask`, shaped like `checked`: an all-zero route
            at an uncaptured position (`filler="zeros"`) gets a message saying so.

    Raises:
        ValueError: At the first bad route (in batch order), naming the
            microbatch, global layer, position and value.

    Examples:
        >>> routes = torch.tensor([[[[0, 1]], [[2, 2]]]])  # B=1, T=2, L=1, K=2
        >>> check_route_values(routes, torch.tensor([[True, False]]), [(0, 0)], 8, microbatch=0)
        >>> check_route_values(routes, torch.tensor([[True, True]]), [(3, 0)], 8, microbatch=0)
        Traceback (most recent call last):
        ...
        ValueError: microbatch 0, layer 3: row 0, token 1: expert id 2 twice in one route [2, 2]; the K=2 experts of a token must be distinct
    """
    index = [i for _, i in layers]
    view = routes if index == list(range(routes.shape[-2])) else routes[..., index, :]
    check_replayed_ids(  # the one host sync per microbatch
        view,
        checked,
        [layer for layer, _ in layers],
        num_experts,
        prefix=f"microbatch {microbatch}, ",
        experts=f"num_moe_experts={num_experts}",
        cu_seqlens=cu_seqlens,
        uncaptured=uncaptured,
    )


def check_model_input(
    mask_shape: Sequence[int], input_shape: Sequence[int], *, microbatch: int, layer: int, name: str = "input_ids"
) -> None:
    """On the first pipeline stage: the routes cover exactly the model's `input_ids`.

    Args:
        mask_shape: Shape of the `padding_mask` built from the routes, `[B, S]`.
        input_shape: Shape of the `input_ids` the model gets, `[B, S]`.
        microbatch: Index of the microbatch in the step.
        layer: The stage's first MoE layer (global, 0-based), for the message.
        name: What `input_shape` is the shape of, for the message.

    Raises:
        ValueError: When the shapes differ, naming the first token without a route.
    """
    check_input_shape(mask_shape, input_shape, where=f"microbatch {microbatch}, layer {layer}", name=name)


def check_router_rows(tokens: int, rows: int, batch_rows: int, *, microbatch: int, layer: int) -> None:
    """At the router call: one route per token the router sees.

    Args:
        tokens: The router's token count (its scores' first dimension).
        rows: Rows of the routes prepared for it (`batch_rows * positions`).
        batch_rows: Batch rows of this rank's routes (1 for the packed layout).
        microbatch: Index of the microbatch in the step.
        layer: The router's global layer (0-based).

    Raises:
        ValueError: When the counts differ, naming the first token without a route.
    """
    if tokens == rows:
        return
    if tokens > rows:  # the routes are sequence-first [S * B]: token `rows` is the first without one
        hint = f"; first token without a route: row {rows % batch_rows}, position {rows // batch_rows} on this rank"
    else:
        hint = f"; {rows - tokens} routes more than tokens"
    check_router_tokens(
        tokens, rows, batch_rows, where=f"microbatch {microbatch}, layer {layer}", scope=" on this rank", hint=hint
    )
