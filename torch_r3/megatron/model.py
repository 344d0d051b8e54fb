"""What the Megatron hooks find in the model they wrap: its chunks and config, its stage's layers, its hybrid
pattern, its padding-mask module, its device.

DDP and Float16Module keep the wrapped model in `.module`; each search walks at
most eight such wrappers down.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core import parallel_state

from torch_r3.megatron.slicing import stage_layer_range

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


def model_config(chunks: list[torch.nn.Module], config: Any | None) -> Any:
    """`config`, or by default the first chunk's `.config` (its `TransformerConfig`).

    Raises:
        TypeError: When `config` is `None` and the chunk has no `.config`.
    """
    if config is None:
        config = getattr(chunks[0], "config", None)
        if config is None:
            raise TypeError("config: the model has no .config; pass its TransformerConfig as config=")
    return config


def stage_layers(chunk: torch.nn.Module, config: Any) -> range:
    """The global layers (0-based) this pipeline stage's chunk holds.

    Raises:
        ValueError: Under pipeline parallelism before Megatron's `parallel_state` is initialized.
    """
    vp_stage = getattr(chunk, "vp_stage", None)
    if parallel_state.model_parallel_is_initialized():
        return stage_layer_range(config, vp_stage=vp_stage)
    pp_size = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if pp_size > 1:
        raise ValueError(
            f"config.pipeline_model_parallel_size={pp_size} but Megatron's parallel_state is "
            "not initialized; cannot tell which layers this pipeline stage holds"
        )
    return stage_layer_range(config, vp_stage=vp_stage, pp_rank=0)
