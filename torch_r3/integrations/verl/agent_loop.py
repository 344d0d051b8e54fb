"""verl's agent-loop side: routes kept per sample, compact, and the tensors verl consumes written once.

verl 0.9.1's agent loop (`experimental/agent_loop/agent_loop.py`) turns each
sample's routes into a zero-filled `int16` `[1, P + R, L, K]` (prompt
left-padded to the configured prompt width `P`, response right-padded to `R`),
concatenates them per worker and ships them to the driver, which strips the
padding again into a jagged nested tensor (`workers/utils/padding.py`,
`left_right_2_no_padding`). Here each sample keeps its captured rows only, in
the narrowest dtype (`compact_sample_routes`; `torch_r3.ray.put_trajectory`
puts them into the object store), and the driver writes the tensor verl
consumes directly, every byte once: the padded `routed_experts`
(`padded_routed_experts`) or the nested one (`nested_routed_experts`), with
verl's `int16` and zero rows where nothing was captured, bit-identical.

Zero rows are verl's convention, and unsafe to replay (expert 0 `K` times:
Megatron's dropless dispatcher needs `K` distinct experts, which is why verl
patches its dispatcher); `replay_mask` marks exactly the captured rows, so
that with `torch_r3.megatron.ReplayHook` the others route live.

How the compact rows travel (what `torch_r3.integrations.verl.install()`
swaps in): `keep_compact` moves each sample's routes into its
`AgentLoopOutput.extra_fields[ROUTES_FIELD]`, which verl's agent loop turns
into a `non_tensor_batch` column of the worker's `DataProto` (one ragged array
per sample, concatenated across workers with the rest of the batch); on the
driver, `driver_routed_experts` writes the nested `routed_experts` from that
column, where `left_right_2_no_padding` would have cut it out of the padded
tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3.collate.collator import collate_routes
from torch_r3.collate.layout import Memory, Packed, PromptResponse, from_keywords
from torch_r3.collate.nested import as_nested
from torch_r3.integrations.verl.lengths import lengths
from torch_r3.keys import CU_SEQLENS, ROUTER_MASK, ROUTES
from torch_r3.routes import compact_routes

__all__ = [
    "ROUTES_FIELD",
    "VERL_DTYPE",
    "compact_sample_routes",
    "driver_routed_experts",
    "keep_compact",
    "nested_routed_experts",
    "padded_routed_experts",
    "replay_mask",
]

VERL_DTYPE = torch.int16
"""The dtype of verl's `routed_experts` (`agent_loop.py` casts every sample's routes to it)."""

ROUTES_FIELD = "r3_routed_experts"
"""The `extra_fields` / `non_tensor_batch` key the compact routes travel under, one array per sample."""


def compact_sample_routes(routed_experts: Any, *, num_experts: int | None = None) -> np.ndarray:
    """One sample's routes as the agent loop keeps them: `[rows, L, K]`, unpadded, narrowest dtype.

    Args:
        routed_experts: what the rollout server returned for the sample
            (`AgentLoopOutput.routed_experts`: an array or a CPU/GPU tensor
            `[rows, L, K]` of expert ids).
        num_experts: the model's expert count, to check the ids against.

    Returns:
        A `uint8`/`int16`/`int32` array (`torch_r3.compact_routes`).

    Raises:
        TypeError, ValueError: as `torch_r3.compact_routes` (negative or
            out-of-range ids, a wrong rank).
    """
    return compact_routes(routed_experts, name="routed_experts", num_experts=num_experts)


def keep_compact(output: Any, *, num_experts: int | None = None) -> None:
    """In verl's agent loop, per sample: keep the routes compact in `output.extra_fields`, not padded.

    Moves `output.routed_experts` (what the rollout server returned,
    `[rows, L, K]`) to `output.extra_fields[ROUTES_FIELD]` as
    `compact_sample_routes` makes it, and sets `output.routed_experts` to
    `None`, so that verl's `_agent_loop_postprocess` builds no padded tensor
    and its `_postprocess` ships the rows in the `DataProto`'s
    `non_tensor_batch`. A sample without routes is left as it is.

    Args:
        output: the sample's `AgentLoopOutput`.
        num_experts: the model's expert count, to check the ids against.

    Raises:
        TypeError, ValueError: as `compact_sample_routes`, naming `routed_experts`.
    """
    routes = getattr(output, "routed_experts", None)
    if routes is None:
        return
    output.extra_fields[ROUTES_FIELD] = compact_sample_routes(routes, num_experts=num_experts)
    output.routed_experts = None


def driver_routed_experts(routes: Sequence[np.ndarray], attention_mask: torch.Tensor) -> torch.Tensor:
    """On verl's driver: the nested `routed_experts` `left_right_2_no_padding` makes, from the compact rows.

    Args:
        routes: the `non_tensor_batch[ROUTES_FIELD]` column, one `[rows_i, L, K]`
            array per sample, in batch order.
        attention_mask: verl's `attention_mask` `[B, P + R]` (prompt
            left-padded, response right-padded); each sample's token count
            is its row's sum.

    Returns:
        The jagged nested `int16` `[B, n_i, L, K]` tensor, bit-identical to
        what `left_right_2_no_padding` cuts out of verl's padded tensor (zeros
        off the captured rows, `int32` offsets).

    Raises:
        ValueError: a row count that is not one per sample, or a sample with
            more captured rows than tokens.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        raise TypeError("attention_mask: expected verl's [B, T] attention_mask tensor")
    counts = attention_mask.sum(1).tolist()
    rows = list(routes)
    if len(rows) != len(counts):
        raise ValueError(f"{ROUTES_FIELD}: expected one array per sample ({len(counts)}), got {len(rows)}")
    nested, _ = nested_routed_experts(rows, counts)
    return nested


def padded_routed_experts(
    routes: Sequence[np.ndarray],
    prompt_lengths: Any,
    response_lengths: Any,
    *,
    layout: PromptResponse | None = None,
    memory: Memory | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """verl's batch `routed_experts` `[B, P + R, L, K]` (int16, zeros off the captured rows), in one write.

    Args:
        routes: each sample's captured rows `[rows_i, L, K]`, a prefix of its
            prompt-then-response tokens.
        prompt_lengths: each sample's prompt tokens `p_i <= P` (ints, NumPy
            integers, or a 1-D integer array or tensor).
        response_lengths: each sample's response tokens `<= R`.
        layout: `torch_r3.PromptResponse(prompt_width=P, response_width=R)`,
            verl's `rollout.prompt_length` and `rollout.response_length`.
        memory: a `torch_r3.Memory` (`workers`: copy threads, default the
            CPUs this process may use; unpinned unless it says otherwise).
        **deprecated: `prompt_width=`, `response_width=` and `workers=`,
            each with a `DeprecationWarning` naming the new spelling.

    Returns:
        `rollout_expert_indices` (verl's `routed_experts`), `router_padding_mask`
        (`True` off the captured rows) and `attention_mask` (verl's), all `[B, P + R, ...]`.
    """
    if layout is None and not {"prompt_width", "response_width"} & set(deprecated):
        raise TypeError(
            "padded_routed_experts needs layout=torch_r3.PromptResponse(prompt_width=P, response_width=R), "
            "verl's rollout.prompt_length and rollout.response_length"
        )
    value, memory = from_keywords(
        "padded_routed_experts",
        "prompt_response" if layout is None else layout,
        memory,
        deprecated,
        keywords=("prompt_width", "response_width", "workers"),
        allowed=(PromptResponse,),
    )
    totals = _totals(prompt_lengths, response_lengths)
    return collate_routes(
        list(routes),
        totals,
        layout=value,
        prompt_lengths=lengths(prompt_lengths, "prompt_lengths"),
        filler="zeros",
        dtype=VERL_DTYPE,
        memory=memory.with_defaults(pin_memory=False),
    )


def nested_routed_experts(
    routes: Sequence[np.ndarray],
    token_counts: Sequence[int],
    *,
    memory: Memory | None = None,
    **deprecated: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nested `routed_experts` verl's engine consumes, written directly (no padded tensor first).

    Equal to what `left_right_2_no_padding` makes of `padded_routed_experts`:
    one jagged component per sample, `[n_i, L, K]` int16, zeros off the captured
    rows, offsets `int32`.

    Args:
        routes: each sample's captured rows `[rows_i, L, K]`.
        token_counts: each sample's tokens `n_i` (prompt plus response).
        memory: a `torch_r3.Memory` (`workers`: copy threads, default the
            CPUs this process may use; unpinned unless it says otherwise).
        **deprecated: `workers=`, with a `DeprecationWarning`.

    Returns:
        `(routed_experts, router_padding_mask)`: both jagged nested tensors over
        one packed buffer each, sharing the offsets.
    """
    _, memory = from_keywords("nested_routed_experts", "packed", memory, deprecated, keywords=("workers",))
    batch = collate_routes(
        list(routes),
        list(token_counts),
        layout=Packed(),
        filler="zeros",
        dtype=VERL_DTYPE,
        memory=memory.with_defaults(pin_memory=False),
    )
    offsets = batch[CU_SEQLENS]
    return as_nested(batch[ROUTES], offsets), as_nested(batch[ROUTER_MASK], offsets)


def replay_mask(router_padding_mask: torch.Tensor) -> torch.Tensor:
    """verl's `replay_mask` form (`True` = replay this row) of a router padding mask: its negation.

    verl's `build_r3_replay_mask` replays every row but each sequence's last,
    right when each sample has `n - 1` captured rows; this marks the captured
    rows themselves, also when a multi-turn rollout captured fewer.
    """
    if not isinstance(router_padding_mask, torch.Tensor) or router_padding_mask.dtype != torch.bool:
        raise TypeError("router_padding_mask: expected a bool tensor (nested or not)")
    if router_padding_mask.is_nested:
        return torch.nested.nested_tensor_from_jagged(
            ~router_padding_mask.values(),
            offsets=router_padding_mask.offsets(),  # type: ignore[attr-defined]  # a jagged tensor's offsets
        )
    return ~router_padding_mask


def _totals(prompt_lengths: Any, response_lengths: Any) -> list[int]:
    prompts = lengths(prompt_lengths, "prompt_lengths")
    responses = lengths(response_lengths, "response_lengths")
    if len(prompts) != len(responses):
        raise ValueError(
            f"prompt_lengths and response_lengths: expected one each per sample, got "
            f"{len(prompts)} and {len(responses)}"
        )
    return [p + r for p, r in zip(prompts, responses)]
