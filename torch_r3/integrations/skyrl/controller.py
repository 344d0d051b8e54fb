"""SkyRL's controller side: its route collation, replaced by `torch_r3.collate_routes`.

SkyRL 0.4.0 (`skyrl/train/dataset/preprocess.py`) packs the rollouts' routes
in `_collate_rollout_expert_indices(rollout_expert_indices, total_real)`, called
by `convert_prompts_responses_to_batch_tensors` from
`RayPPOTrainer.convert_to_training_input`, one segment at a time on one
thread, into a fresh buffer. `collate_rollout_expert_indices` here takes the
same arguments and returns SkyRL's own `PackedTensor`, bit- and dtype-identical
(the uncaptured tail of each trajectory holds experts `0..K-1`, `cu_seqlens` is
`int32`), written once by `torch_r3`'s thread pool, optionally into a
`torch_r3.BufferPool`'s recycled memory. `install()` swaps it in: SkyRL looks the
function up in its module at call time, so replacing the module attribute is
the whole swap.

`make_router_padding_mask` is SkyRL's function of that name with one more
check: the `attention_mask` must be left-padded, as SkyRL's layout is (SkyRL's
own computes a wrong mask from a right-padded one, silently).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

from torch_r3.collate import collate_routes
from torch_r3.keys import CU_SEQLENS, ROUTES
from torch_r3.layout import Memory, Packed, from_keywords

__all__ = ["Installed", "collate_rollout_expert_indices", "install", "make_router_padding_mask"]

PREPROCESS = "skyrl.train.dataset.preprocess"
"""The SkyRL module whose functions `install` replaces."""

PACKED_TENSOR = "skyrl.backends.skyrl_train.utils.packed_tensor"
"""The SkyRL module that defines `PackedTensor`."""

_COLLATE = "_collate_rollout_expert_indices"  # SkyRL's name for its collation, looked up at call time
_MASK = "make_router_padding_mask"
_MARKER = "_torch_r3_installed"  # set on the module while installed: a second install is refused


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
        "collate_rollout_expert_indices", "packed", memory, deprecated, memory_keywords=("buffers", "workers")
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
        captured_route_lengths: captured route rows per trajectory, `0 <= c_i <= n_i`.

    Returns:
        A bool `[B, T]` tensor on the mask's device, equal to SkyRL 0.4.0's.

    Raises:
        TypeError: `attention_mask` is not an integer or bool tensor.
        ValueError: a wrong shape, a row that is not left-padded, or a length
            out of range (naming the trajectory).
    """
    lengths = left_padded_lengths(attention_mask)
    b, t = attention_mask.shape
    if len(captured_route_lengths) != b:
        raise ValueError(
            f"captured_route_lengths: expected {b} lengths (one per trajectory), got {len(captured_route_lengths)}"
        )
    for i, c in enumerate(captured_route_lengths):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) <= int(lengths[i]):
            raise ValueError(
                f"captured_route_lengths[{i}]: expected an int in [0, {int(lengths[i])}] (the trajectory's "
                f"tokens), got {c!r}"
            )
    positions = torch.arange(t, device=attention_mask.device)
    captured = torch.as_tensor([int(c) for c in captured_route_lengths], dtype=torch.long, device=positions.device)
    start = t - lengths
    return ~((positions >= start.unsqueeze(1)) & (positions < (start + captured).unsqueeze(1)))


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


@contextmanager
def _swapped(module: Any, replacements: dict[str, Any]) -> Iterator[None]:
    missing = object()
    originals = {name: getattr(module, name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


class Installed:
    """The swap `install()` made: `uninstall()` (or leaving the `with` block) puts SkyRL's functions back."""

    def __init__(self, module: Any, names: Sequence[str], stack: ExitStack) -> None:
        self.module = module
        self.names = tuple(names)
        self._stack: ExitStack | None = stack

    def __repr__(self) -> str:
        state = "installed" if self._stack is not None else "uninstalled"
        return f"Installed({self.module.__name__}: {', '.join(self.names)}; {state})"

    def uninstall(self) -> None:
        """Restore SkyRL's own functions; a second call does nothing."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(*, memory: Memory | None = None, **deprecated: Any) -> Installed:
    """Swap `torch_r3`'s collation into SkyRL's controller: one call, before training starts.

    Replaces `skyrl.train.dataset.preprocess._collate_rollout_expert_indices`
    (looked up at call time by `convert_prompts_responses_to_batch_tensors`)
    and `make_router_padding_mask` in that module. `skyrl.train.trainer`
    imports `make_router_padding_mask` by name; where that module is already
    imported, its name is replaced too.

    Args:
        memory: a `torch_r3.Memory`, as in `collate_rollout_expert_indices`:
            its `buffers`, a `torch_r3.BufferPool` every step's packed routes
            come from (recycled once SkyRL drops the step's batch; by default
            fresh memory), and `workers`, copy threads.
        **deprecated: `buffers=` and `workers=`, each with a `DeprecationWarning`.

    Returns:
        An `Installed` handle: `uninstall()` restores SkyRL's functions (it is
        also a context manager).

    Raises:
        RuntimeError: when torch_r3 is already installed there.
        ModuleNotFoundError: when SkyRL is not installed.
    """
    _, memory = from_keywords("install", "packed", memory, deprecated, memory_keywords=("buffers", "workers"))
    module = importlib.import_module(PREPROCESS)
    if getattr(module, _MARKER, False):
        raise RuntimeError(f"torch_r3 is already installed in {PREPROCESS}; uninstall() the first handle")

    def collate(rollout_expert_indices: Sequence[np.ndarray], total_real: np.ndarray) -> Any:
        return collate_rollout_expert_indices(rollout_expert_indices, total_real, memory=memory)

    collate.__doc__ = collate_rollout_expert_indices.__doc__
    replacements = {_COLLATE: collate, _MASK: make_router_padding_mask, _MARKER: True}
    stack = ExitStack()
    stack.enter_context(_swapped(module, replacements))
    trainer = sys.modules.get("skyrl.train.trainer")
    if trainer is not None and hasattr(trainer, _MASK):
        stack.enter_context(_swapped(trainer, {_MASK: make_router_padding_mask}))
    return Installed(module, [_COLLATE, _MASK], stack)
