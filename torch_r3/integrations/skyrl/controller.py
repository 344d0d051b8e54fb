"""SkyRL's controller side: its route collation, replaced by `torch_r3.collate_routes`.

SkyRL 0.4.0 (`skyrl/train/dataset/preprocess.py`) packs the rollouts' routes
in `_collate_rollout_expert_indices(rollout_expert_indices, total_real)`, called
by `convert_prompts_responses_to_batch_tensors` from
`RayPPOTrainer.convert_to_training_input`, one segment at a time on one
thread, into a fresh buffer. `collate_rollout_expert_indices` here takes the
same arguments and returns SkyRL's own `PackedTensor`, bit- and dtype-identical
(the uncaptured tail of each trajectory holds experts `0..K-1`, `cu_seqlens` is
`int32`), written once by `torch_r3`'s thread pool, optionally into a
`torch_r3.BufferPool`'s recycled memory. `torch_r3.integrations.skyrl.install()`
swaps it in: SkyRL looks the function up in its module at call time, so
replacing the module attribute is the whole swap.

`make_router_padding_mask` is SkyRL's function of that name with one more
check: the `attention_mask` must be left-padded, as SkyRL's layout is (SkyRL's
own computes a wrong mask from a right-padded one, silently).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3.collate.collator import collate_routes
from torch_r3.collate.layout import Memory, Packed, from_keywords
from torch_r3.keys import CU_SEQLENS, ROUTES

__all__ = [
    "COLLATE",
    "MASK",
    "PREPROCESS",
    "collate_rollout_expert_indices",
    "make_router_padding_mask",
    "route_length",
]

PREPROCESS = "skyrl.train.dataset.preprocess"
"""The SkyRL module whose functions `install` replaces."""

PACKED_TENSOR = "skyrl.backends.skyrl_train.utils.packed_tensor"
"""The SkyRL module that defines `PackedTensor`."""

COLLATE = "_collate_rollout_expert_indices"
"""SkyRL's name for its collation in `PREPROCESS`, looked up at call time."""

MASK = "make_router_padding_mask"
"""SkyRL's router mask function in `PREPROCESS`; `skyrl.train.trainer` imports it by name."""


def _packed_tensor_class() -> Any:
    return importlib.import_module(PACKED_TENSOR).PackedTensor


def collate_rollout_expert_indices(
    rollout_expert_indices: Sequence[np.ndarray],
    total_real: Sequence[int] | np.ndarray,
    *,
    memory: Memory | None = None,
    **deprecated: Any,
) -> Any:
    """SkyRL's route collation, by `torch_r3`: one `PackedTensor` of every trajectory's routes.

    Args:
        rollout_expert_indices: one `[rows_i, L, K]` array per trajectory
            (`uint8`, `int16` or `int32`, as SkyRL's `pack_routed_experts`
            sends them), `rows_i <= total_real[i]`.
        total_real: each trajectory's token count (prompt plus response).
        memory: a `torch_r3.Memory`: its `buffers`, a `torch_r3.BufferPool` to
            take the packed buffer from, so that successive steps reuse memory
            (by default a fresh buffer); `workers`, copy threads (default: the
            CPUs this process may use); `pin_memory` (default `False`: SkyRL
            moves the batch itself); `max_output_bytes`.
        **deprecated: `buffers=` and `workers=`, each with a `DeprecationWarning`.

    Returns:
        SkyRL's `PackedTensor`: values `[sum(total_real), L, K]` of the widest
        input dtype, the uncaptured tail of each segment `0..K-1`, and `int32`
        `cu_seqlens`; what SkyRL 0.4.0's `_collate_rollout_expert_indices` returns.

    Raises:
        TypeError: an entry is not an array (naming the sample).
        ValueError: a wrong dtype, shape, or more rows than tokens (naming the sample).

    One difference from SkyRL's: a trajectory with no captured row (`[0, L, K]`)
    is collated (its segment all filler, its `router_padding_mask` all `True`)
    where SkyRL 0.4.0 refuses it.
    """
    if isinstance(rollout_expert_indices, (np.ndarray, torch.Tensor)) or not isinstance(
        rollout_expert_indices, Sequence
    ):
        raise TypeError(
            f"rollout_expert_indices: expected a list of per-trajectory arrays, got {type(rollout_expert_indices).__name__}"
        )
    _, memory = from_keywords(
        "collate_rollout_expert_indices", "packed", memory, deprecated, keywords=("buffers", "workers")
    )
    batch = collate_routes(
        list(rollout_expert_indices),
        total_real,  # type: ignore[arg-type]  # an int64 array as SkyRL passes it; checked per entry
        layout=Packed(),
        filler="arange",
        memory=memory.with_defaults(pin_memory=False),  # SkyRL moves the batch to the device itself
    )
    return _packed_tensor_class()(batch[ROUTES], batch[CU_SEQLENS])


def make_router_padding_mask(attention_mask: torch.Tensor, captured_route_lengths: Sequence[int]) -> torch.Tensor:
    """SkyRL's `[B, T]` router padding mask: `True` on left padding and on tokens without a captured route.

    Args:
        attention_mask: `[B, T]`, 1 on real tokens, left-padded (each row
            zeros then ones), integer or bool.
        captured_route_lengths: captured route rows per trajectory, `0 <= c_i <= n_i`:
            Python or NumPy integers, 0-d integer tensors, or one 1-D integer
            tensor or array.

    Returns:
        A bool `[B, T]` tensor on the mask's device, equal to SkyRL 0.4.0's.

    Raises:
        TypeError: `attention_mask` is not an integer or bool tensor, or a
            length is not an integer (naming the trajectory).
        ValueError: a wrong shape, a row that is not left-padded, or a length
            out of range (naming the trajectory).
    """
    lengths = left_padded_lengths(attention_mask)
    b, t = attention_mask.shape
    if isinstance(captured_route_lengths, (torch.Tensor, np.ndarray)) and captured_route_lengths.ndim != 1:
        raise TypeError(
            f"captured_route_lengths: expected one length per trajectory, got an array of shape "
            f"{list(captured_route_lengths.shape)}"
        )
    if len(captured_route_lengths) != b:
        raise ValueError(
            f"captured_route_lengths: expected {b} lengths (one per trajectory), got {len(captured_route_lengths)}"
        )
    counts = [
        route_length(c, f"captured_route_lengths[{i}]", int(lengths[i])) for i, c in enumerate(captured_route_lengths)
    ]
    positions = torch.arange(t, device=attention_mask.device)
    captured = torch.as_tensor(counts, dtype=torch.long, device=positions.device)
    start = t - lengths
    return ~((positions >= start.unsqueeze(1)) & (positions < (start + captured).unsqueeze(1)))


def route_length(value: object, what: str, limit: int) -> int:
    """One trajectory's route-row count as an `int` in `[0, limit]`: a Python, NumPy or 0-d tensor integer.

    Raises:
        TypeError: not an integer (a float, a bool, a tensor of another shape), naming `what`.
        ValueError: an integer out of `[0, limit]` (the trajectory's tokens), naming `what`.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise TypeError(f"{what}: expected an integer, got a tensor of shape {list(value.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{what}: expected an integer, got a {value.dtype} tensor")
        number = int(value.item())
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: expected an integer, got {value!r}")
    else:
        number = int(value)
    if not 0 <= number <= limit:
        raise ValueError(f"{what}: {number} is out of range [0, {limit}] (the trajectory's tokens)")
    return number


def left_padded_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's token count of a left-padded `[B, T]` attention mask (SkyRL's batch layout).

    Raises:
        TypeError: not an integer or bool tensor.
        ValueError: not `[B, T]`, or a row that is not zeros then ones (naming the row).
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype.is_floating_point:
        what = attention_mask.dtype if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise TypeError(f"attention_mask: expected an integer or bool [B, T] tensor, got {what}")
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask: expected [B, T], got shape {list(attention_mask.shape)}")
    t = attention_mask.shape[1]
    real = attention_mask != 0
    lengths = real.sum(1)
    positions = torch.arange(t, device=attention_mask.device)
    bad = ((positions >= (t - lengths).unsqueeze(1)) != real).any(1).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"attention_mask[{i}]: expected a left-padded row (zeros, then {int(lengths[i])} ones), got "
            f"{attention_mask[i].tolist()}; SkyRL's batch layout left-pads every trajectory"
        )
    return lengths
