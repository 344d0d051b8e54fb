"""The names of the keys in a collated batch: one home for every module that reads them.

`collate_routes` and `R3Collator` write these keys; the Megatron hook, the
benchmark and the demo read them. The layout behind each key is described in
the "Batch layout" page (`docs/concepts/route-layout.md`).

Examples:
    >>> from torch_r3.keys import ROUTES, ROUTER_MASK
    >>> ROUTES, ROUTER_MASK
    ('rollout_expert_indices', 'router_padding_mask')
"""

from __future__ import annotations

__all__ = ["ATTENTION_MASK", "CU_SEQLENS", "INPUT_IDS", "OUTPUT_KEYS", "ROUTER_MASK", "ROUTES", "SAMPLE_ROUTES"]

#: Routes of the batch: `[B, T, L, K]` (padded) or `[sum(n), L, K]` (packed).
ROUTES = "rollout_expert_indices"
#: `True` where a token position has no captured route (padding).
ROUTER_MASK = "router_padding_mask"
#: `[B, T]` `torch.long`, 1 for real tokens, 0 for left padding (padded layout only).
ATTENTION_MASK = "attention_mask"
#: `[B + 1]` `torch.int32` sequence offsets (packed layout only).
CU_SEQLENS = "cu_seqlens"
#: The batch's token ids (and `R3Collator`'s default tokens key).
INPUT_IDS = "input_ids"
#: Every key the collation kernel or `R3Collator` computes; a sample may not carry one.
OUTPUT_KEYS = frozenset({ROUTES, ROUTER_MASK, ATTENTION_MASK, CU_SEQLENS, INPUT_IDS})
#: `R3Collator`'s default key for a sample's routes.
SAMPLE_ROUTES = "routes"
