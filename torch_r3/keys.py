"""The names of the keys in a collated batch: one home for every module that reads them.

`collate_routes` and `R3Collator` write these keys; the Megatron hook, the
benchmark and the demo read them. The layout behind each key is described on the
route layout page of the documentation.

Examples:
    >>> from torch_r3.keys import ROUTES, ROUTER_MASK
    >>> ROUTES, ROUTER_MASK
    ('rollout_expert_indices', 'router_padding_mask')
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_MASK",
    "CU_SEQLENS",
    "CU_SEQLENS_PADDED",
    "INPUT_IDS",
    "OUTPUT_KEYS",
    "PROMPT_LENGTH",
    "ROUTER_MASK",
    "ROUTES",
    "SAMPLE_ROUTES",
]

ROUTES = "rollout_expert_indices"
"""Routes of the batch: `[B, T, L, K]` (padded) or `[sum(n), L, K]` (packed)."""

ROUTER_MASK = "router_padding_mask"
"""`True` where a token position has no captured route (padding)."""

ATTENTION_MASK = "attention_mask"
"""`[B, T]` `torch.long`, 1 for real tokens, 0 for padding (padded and prompt_response layouts)."""

CU_SEQLENS = "cu_seqlens"
"""`[B + 1]` `torch.int32` cumulative real sequence lengths (packed layout only).

Without per-sequence alignment these are also the sequences' offsets into the packed tensors.
"""

CU_SEQLENS_PADDED = "cu_seqlens_padded"
"""`[B + 1]` `torch.int32` offsets of the aligned sequences (packed layout with `pad_to_multiple_of` only).

Sequence `i` holds rows `[cu_seqlens_padded[i], cu_seqlens_padded[i] + n_i)`, then its alignment rows.
"""

INPUT_IDS = "input_ids"
"""The batch's token ids (and `R3Collator`'s default tokens key)."""

OUTPUT_KEYS = frozenset({ROUTES, ROUTER_MASK, ATTENTION_MASK, CU_SEQLENS, CU_SEQLENS_PADDED, INPUT_IDS})
"""Every key the collation kernel or `R3Collator` computes; a sample may not carry one."""

SAMPLE_ROUTES = "routes"
"""`R3Collator`'s default key for a sample's routes."""

PROMPT_LENGTH = "prompt_length"
"""`R3Collator`'s default key for a sample's prompt token count (`layout="prompt_response"`)."""
