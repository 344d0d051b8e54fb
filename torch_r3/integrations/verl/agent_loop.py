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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3.collate import collate_routes
from torch_r3.keys import CU_SEQLENS, ROUTER_MASK, ROUTES
from torch_r3.layout import Memory, Packed, PromptResponse, from_keywords
from torch_r3.nested import as_nested
from torch_r3.routes import compact_routes

__all__ = ["VERL_DTYPE", "compact_sample_routes", "nested_routed_experts", "padded_routed_experts", "replay_mask"]

VERL_DTYPE = torch.int16
"""The dtype of verl's `routed_experts` (`agent_loop.py` casts every sample's routes to it)."""


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


def padded_routed_experts(
    routes: Sequence[np.ndarray],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    layout: PromptResponse | None = None,
    memory: Memory | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """verl's batch `routed_experts` `[B, P + R, L, K]` (int16, zeros off the captured rows), in one write.

    Args:
        routes: each sample's captured rows `[rows_i, L, K]`, a prefix of its
            prompt-then-response tokens.
        prompt_lengths: each sample's prompt tokens `p_i <= P`.
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
        allowed=(PromptResponse,),
        memory_keywords=("workers",),
    )
    totals = _totals(prompt_lengths, response_lengths)
    return collate_routes(
        list(routes),
        totals,
        layout=value,
        prompt_lengths=list(prompt_lengths),
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
    _, memory = from_keywords("nested_routed_experts", "packed", memory, deprecated, memory_keywords=("workers",))
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


def _totals(prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> list[int]:
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(
            f"prompt_lengths and response_lengths: expected one each per sample, got "
            f"{len(prompt_lengths)} and {len(response_lengths)}"
        )
    totals = []
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        for name, v in (("prompt_lengths", p), ("response_lengths", r)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name}[{i}]: expected an int >= 0, got {v!r}")
        totals.append(int(p) + int(r))
    return totals
