"""What `ReplayHook` finds in the model it wraps: its chunks, its hybrid pattern, its padding-mask module, its device.

DDP and Float16Module keep the wrapped model in `.module`; each search walks at
most eight such wrappers down.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__: list[str] = []  # the hook's internals

_MAX_WRAPPERS = 8


def as_chunks(model: Any) -> list[torch.nn.Module]:
    """A model or a list of model chunks as a list of modules.

    Raises:
        ValueError: When the list is empty.
        TypeError: When an element is not a `torch.nn.Module`.
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("model: got an empty list of model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model[{i}]: expected a torch.nn.Module, got {type(chunk).__name__}")
    return chunks


def find_hybrid_pattern(chunk: torch.nn.Module) -> str | None:
    """A HybridModel's layer pattern (`hybrid_layer_pattern`), or `None` for another model."""
    module: Any = chunk
    for _ in range(_MAX_WRAPPERS):
        pattern = getattr(module, "hybrid_layer_pattern", None)
        if isinstance(pattern, str):
            return pattern
        module = getattr(module, "module", None)
        if not isinstance(module, torch.nn.Module):
            return None
    return None


def find_padding_mask_module(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """The innermost module whose forward takes `padding_mask` (GPTModel in megatron-core >= 0.16), or `None`."""
    module = chunk
    found = None
    for _ in range(_MAX_WRAPPERS):
        try:
            if "padding_mask" in inspect.signature(module.forward).parameters:
                found = module
        except (TypeError, ValueError):
            pass
        inner = getattr(module, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return found


def first_device(chunk: torch.nn.Module) -> torch.device:
    """The device of the chunk's first parameter (CPU when it has none)."""
    for p in chunk.parameters():
        return p.device
    return torch.device("cpu")
