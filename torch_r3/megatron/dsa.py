"""Megatron-core's DeepSeek Sparse Attention as the indexer replay sees it.

Where the DSA module is and what it must have (`dsa_module`), the model
settings under which a top-k can be replayed at all (`check_dsa_config`,
`topk_sharing`), and a microbatch's selections as one context- or
sequence-parallel rank uses them (`selections_for_rank`, `query_rows`).
`torch_r3.megatron.indexer.IndexerReplayHook` stands on these.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from megatron.core import parallel_state

from torch_r3.megatron.slicing import context_parallel_positions, sequence_parallel_positions
from torch_r3.replay.modes import check_uncaptured
from torch_r3.selections import FILL

__all__ = [
    "DSA_MODULE",
    "TOPK_FUNCTION",
    "canonical_order",
    "check_dsa_config",
    "context_parallel_rank",
    "dsa_module",
    "query_rows",
    "selections_for_rank",
    "topk_sharing",
]

DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"
"""The megatron-core module that holds `DSAttention` and the top-k the hook replays (0.19)."""

TOPK_FUNCTION = "fused_qk_topk_naive"
"""The module-level function of `DSA_MODULE` through which every unfused DSA top-k is computed."""


def dsa_module() -> Any:
    """Megatron's DSA module, after checking it has what replay needs.

    Raises:
        ImportError: This megatron-core has no DSA (0.16 has none) or a DSA
            module without `DSAttention` and `fused_qk_topk_naive`.
    """
    try:
        from megatron.core import __version__ as version
    except ImportError:  # pragma: no cover - every release has it
        version = "?"
    try:
        module = importlib.import_module(DSA_MODULE)
    except ImportError as err:
        raise ImportError(
            f"megatron-core {version} has no DeepSeek Sparse Attention ({DSA_MODULE} is missing); "
            "torch_r3.megatron.IndexerReplayHook needs megatron-core 0.19 (checked against 0.19.2)"
        ) from err
    missing = [name for name in ("DSAttention", TOPK_FUNCTION, "is_dsa_skip_topk_layer") if not hasattr(module, name)]
    if missing:
        raise ImportError(
            f"megatron-core {version}: its DSA ({DSA_MODULE}) predates the structure IndexerReplayHook replays "
            f"(it has no {', '.join(missing)}; 0.16's DSAttention takes its top-k from "
            "DSAIndexer.forward_with_scores); the hook needs megatron-core 0.19 (checked against 0.19.2)"
        )
    return module


def selections_for_rank(
    sel: torch.Tensor, mask: torch.Tensor, cp_size: int = 1, cp_rank: int = 0, *, uncaptured: str = "live"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded microbatch's checked selections as one context-parallel rank's `DSAttention` uses them.

    Rows are cut to the rank's two sequence chunks (`context_parallel_positions`);
    the values are kept, since the positions name keys of the whole sequence,
    which Megatron's allgather DSA gathers on every rank. Each row is sorted,
    `-1` after; with `uncaptured="replay"` an uncaptured row selects its own
    position only. The result is a new tensor in `sel`'s dtype: the memory it
    adds is the compact selections' bytes, plus one layer's sort temporaries.

    Args:
        sel: `[B, T, L, K]` selections in batch positions, checked.
        mask: `[B, T]`, `True` where a row has no captured selection.
        cp_size: Context-parallel world size.
        cp_rank: This rank's context-parallel rank.
        uncaptured: `"live"` or `"replay"` (see `IndexerReplayHook`).

    Returns:
        `(selections [B, T / cp_size, L, K], mask [B, T / cp_size], positions [T / cp_size])`:
        the selections in `sel`'s own (compact) dtype, widened only by the layer
        that hands them to the attention; the batch position of each kept row in
        `positions`.

    Examples:
        >>> sel = torch.tensor([[[[0, -1]], [[1, 0]], [[2, 1]], [[1, 3]]]])  # B=1, T=4, L=1, K=2
        >>> mask = torch.zeros(1, 4, dtype=torch.bool)
        >>> local, _, positions = selections_for_rank(sel, mask, cp_size=2, cp_rank=1)
        >>> positions.tolist(), local[0, :, 0].tolist()
        ([1, 2], [[0, 1], [1, 2]])
    """
    check_uncaptured(uncaptured)
    B, T = mask.shape
    positions = context_parallel_positions(T, cp_size, cp_rank).to(sel.device)
    if cp_size > 1:
        sel, mask = sel[:, positions], mask[:, positions]
    local = torch.empty_like(sel)
    for layer in range(sel.shape[2]):  # one layer's sort temporaries at a time
        local[:, :, layer] = canonical_order(sel[:, :, layer])
    if uncaptured == "replay":
        itself = torch.full_like(local, FILL)
        itself[..., 0] = positions.view(1, -1, 1)
        local = torch.where(mask.view(B, -1, 1, 1), itself, local)
    return local, mask, positions


def canonical_order(sel: torch.Tensor) -> torch.Tensor:
    """Each row of `sel` (`[..., K]`) sorted, its `-1` slots after the positions, in `sel`'s own dtype.

    The unused slots sort last under the dtype's largest value; they are then set
    back to `-1` by their count, so a real position equal to that value stays.

    Examples:
        >>> canonical_order(torch.tensor([[3, -1, 1], [-1, 32767, 0]], dtype=torch.int16)).tolist()
        [[1, 3, -1], [0, 32767, -1]]
    """
    unused = sel == FILL
    K = sel.shape[-1]
    ordered = sel.masked_fill(unused, torch.iinfo(sel.dtype).max).sort(dim=-1).values
    tail = torch.arange(K, device=sel.device) >= K - unused.sum(-1, keepdim=True)
    return ordered.masked_fill_(tail, FILL)


def topk_sharing(config: Any) -> tuple[int, int]:
    """`(dsa_indexer_skip_topk_offset, dsa_indexer_topk_freq)`: which layers compute a top-k and which reuse one."""
    return int(getattr(config, "dsa_indexer_skip_topk_offset", 0) or 0), int(
        getattr(config, "dsa_indexer_topk_freq", 1) or 1
    )


def check_dsa_config(config: Any, dsa: Any) -> None:
    """Refuse a model config whose DSA top-k no replayed selection can reach.

    Raises:
        ValueError: No DSA, the fused DSA kernels, or a CUDA graph.
    """
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        raise ValueError(
            f"config.experimental_attention_variant={getattr(config, 'experimental_attention_variant', None)!r}: "
            "the model has no DeepSeek Sparse Attention; build it with experimental_attention_variant='dsa'"
        )
    kernels = importlib.import_module(DSA_MODULE.rsplit(".", 1)[0] + ".dsa_kernels")
    if kernels.use_fused_dsa_kernels(config):
        raise ValueError(
            f"config.dsa_kernel_backend={config.dsa_kernel_backend!r} with attention_backend="
            f"{config.attention_backend!s}: the fused DSA kernels compute the indexer top-k inside CUDA code, "
            "where no replayed selection can be given to them; set dsa_kernel_backend='none' (or "
            "attention_backend='unfused')"
        )
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        raise ValueError(
            f"config.cuda_graph_impl={impl!r}: a CUDA graph replays the top-k of its capture run and never "
            "consults the selections installed per microbatch; set cuda_graph_impl='none'"
        )


def query_rows(local: int, seen: int, microbatch: int, layer: int) -> slice:
    """The rows of this rank's selections a layer's top-k covers: all, or this TP rank's sequence-parallel share."""
    if seen == local:
        return slice(None)
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if tp > 1 and seen * tp == local:
        return sequence_parallel_positions(local, tp, parallel_state.get_tensor_model_parallel_rank())
    raise ValueError(
        f"microbatch {microbatch}, layer {layer}: the layer's top-k covers {seen} query rows but the batch holds "
        f"{local} on this rank (a sequence length other than the batch's?)"
    )


def context_parallel_rank() -> tuple[int, int]:
    """`(context-parallel world size, rank)`; `(1, 0)` before `parallel_state` is initialized."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
