"""verl's Megatron engine side: its R3 alignment, replaced by `torch_r3.megatron.ReplayHook`.

verl 0.9.1's `MegatronEngine` (`workers/engine/megatron/transformer_impl.py`)
replays per micro-batch inside its own forward step: `align_r3_router_replay_data`
appends a zero row to each sequence with `n - 1` routes, `build_r3_replay_mask`
marks every row but each sequence's last for replay, and `set_router_replay_data`
packs both with `preprocess_thd_engine` (each sequence padded to the TP/CP
alignment), scatters them for sequence parallelism and writes them into verl's
own `RouterReplay` (a monkeypatch of Megatron's `TopKRouter`,
`utils/megatron/router_replay_patch.py`).

`microbatch` takes one micro-batch in verl's no-padding form (the nested
`routed_experts` and `input_ids` of `left_right_2_no_padding`) and writes the
packed batch the hook replays: the captured rows of each sequence (a prefix;
verl's zero rows after it are not replayed but routed live), each sequence
aligned to `pad_to_multiple_of` as `preprocess_thd_engine` aligns it, with
`cu_seqlens` and `cu_seqlens_padded`. The hook then does the layer selection,
sequence- and context-parallel slicing and recompute FIFO, with validation at
use, drift statistics and the skipped-replay tripwire.

`torch_r3.integrations.verl.install()` hands the engine a schedule that runs
each micro-batch through `microbatch` and the hook (`schedule.EngineReplay`);
what stays verl's, and why, is said there.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_r3.collate.collator import R3Collator
from torch_r3.collate.layout import Memory, Packed, from_keywords
from torch_r3.integrations.verl.lengths import lengths
from torch_r3.keys import INPUT_IDS, SAMPLE_ROUTES

__all__ = ["captured_lengths", "microbatch"]


def _components(nested: Any, name: str) -> list[torch.Tensor]:
    if not isinstance(nested, torch.Tensor) or not nested.is_nested:
        raise TypeError(f"{name}: expected verl's jagged nested tensor, got {type(nested).__name__}")
    return list(nested.unbind())


def captured_lengths(routed_experts: torch.Tensor) -> list[int]:
    """Each sequence's captured rows in verl's nested `routed_experts`: the rows before its trailing zero rows.

    verl fills rows without a route with zeros; a captured route holds `K`
    distinct experts, so for `K > 1` it is never all zeros.

    Raises:
        TypeError: not a nested tensor.
        ValueError: `K == 1` (a captured route `[0]` looks like a zero row:
            pass the captured lengths to `microbatch` instead), or an all-zero
            row before a captured one (naming the sequence).
    """
    lengths = []
    for i, rows in enumerate(_components(routed_experts, "routed_experts")):
        if rows.ndim != 3:
            raise ValueError(f"routed_experts[{i}]: expected [n, L, K], got {list(rows.shape)}")
        if rows.shape[-1] == 1:
            raise ValueError(
                "routed_experts: with K = 1 a captured route [0] cannot be told from verl's zero filler; "
                "pass captured= to microbatch"
            )
        zero = (rows == 0).flatten(1).all(1)
        captured = int((~zero).nonzero().max()) + 1 if bool((~zero).any()) else 0
        if bool(zero[:captured].any()):
            raise ValueError(
                f"routed_experts[{i}]: row {int(zero[:captured].nonzero()[0])} is all zeros (no route) before "
                f"captured row {captured - 1}; captured rows must be a prefix of the sequence"
            )
        lengths.append(captured)
    return lengths


def microbatch(
    routed_experts: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    captured: Any = None,
    layout: Packed | str = "packed",
    memory: Memory | None = None,
    **deprecated: Any,
) -> dict[str, torch.Tensor]:
    """One verl micro-batch as the packed batch `torch_r3.megatron.ReplayHook` replays.

    Args:
        routed_experts: verl's nested `routed_experts` `[B, j, L, K]` (from
            `left_right_2_no_padding`, or `nested_routed_experts`).
        input_ids: verl's nested `input_ids` `[B, j]`.
        captured: each sequence's captured rows (ints, NumPy integers, or a
            1-D integer array or tensor); by default `captured_lengths`.
        layout: `torch_r3.Packed(pad_to_multiple_of=)`, with
            `preprocess_thd_engine`'s alignment (TP size, times `2 * CP` under
            context parallelism): each sequence padded to a multiple of it,
            with `cu_seqlens_padded`.
        memory: a `torch_r3.Memory`; its `buffers`, a `torch_r3.BufferPool`
            to take the batch from (unpinned unless it says otherwise).
        **deprecated: `pad_to_multiple_of=` and `buffers=`, each with a
            `DeprecationWarning` naming the new spelling.

    Returns:
        `input_ids` `[N]`, `rollout_expert_indices` `[N, L, K]`,
        `router_padding_mask` `[N]` (`True` off the captured rows),
        `cu_seqlens` and, aligned, `cu_seqlens_padded`.

    Raises:
        TypeError: not nested tensors.
        ValueError: sequences whose route and token counts differ by more
            than verl allows (`n` or `n - 1` rows), or a bad `captured`.
    """
    packed, memory = from_keywords(
        "microbatch", layout, memory, deprecated, keywords=("pad_to_multiple_of", "buffers"), allowed=(Packed,)
    )
    routes = _components(routed_experts, "routed_experts")
    ids = _components(input_ids, "input_ids")
    if len(routes) != len(ids):
        raise ValueError(f"routed_experts has {len(routes)} sequences, input_ids {len(ids)}")
    for i, (r, t) in enumerate(zip(routes, ids)):
        if r.shape[0] not in (t.shape[0], t.shape[0] - 1):
            raise ValueError(
                f"routed_experts[{i}]: {r.shape[0]} rows for {t.shape[0]} tokens; verl's batch has n or n - 1"
            )
    if captured is None:
        rows = captured_lengths(routed_experts)
    else:
        rows = lengths(captured, "captured", upper=[r.shape[0] for r in routes])
    samples = [{INPUT_IDS: t, SAMPLE_ROUTES: r[:c].cpu().numpy()} for r, t, c in zip(routes, ids, rows)]
    # Only an aligned batch pads input_ids: its alignment rows lie outside cu_seqlens, which the model attends
    # by, so their token id (0 here, as before pad_token_id was required) is never read as a token.
    memory = memory.with_defaults(pin_memory=False)
    collator = R3Collator(layout=packed, filler="arange", memory=memory, pad_token_id=0)
    return collator(samples)
