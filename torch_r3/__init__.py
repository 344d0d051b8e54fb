"""Routed-expert replay (R3) plumbing for PyTorch and Megatron RL trainers.

`import torch_r3` stays quick and imports neither Megatron nor aiohttp: the
client, codec and trace names are resolved on first use, and the Megatron hook
lives in `torch_r3.megatron`. A part whose optional dependency is missing says
which extra installs it (`pip install 'torch_r3[megatron]'`, `'torch_r3[client]'`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch_r3.routes import CANONICAL_DTYPES, canonical_dtype_for, check_expert_ids, compact_routes
from torch_r3._buffers import BufferPool
from torch_r3._memory import accelerator_available
from torch_r3.collate import R3Collator, collate_routes
from torch_r3.layout import BatchLayout, global_layout
from torch_r3.shard import ShardCollator, plan_microbatches

__version__ = "0.1.0"

# name -> module that defines it; imported lazily (PEP 562) so that the core
# import never pulls in aiohttp.
_LAZY = {
    "encode_routes": "torch_r3.codec",
    "decode_routes": "torch_r3.codec",
    "decode_sglang_routes": "torch_r3.codec",
    "decode_vllm_routes": "torch_r3.codec",
    "decode_npy": "torch_r3.codec",
    "base64_decoded_length": "torch_r3.codec",
    "WireFormatError": "torch_r3.codec",
    "RoutedExpertTrace": "torch_r3.trace",
    "TokenMetadataTrace": "torch_r3.trace",
    "RemoteGenerateClient": "torch_r3.client",
    "RemoteGenerateResult": "torch_r3.client",
    "RemoteGenerateError": "torch_r3.client",
    "ZeroRoutesWarning": "torch_r3.client",
}

__all__ = [
    "BatchLayout",
    "BufferPool",
    "CANONICAL_DTYPES",
    "R3Collator",
    "ShardCollator",
    "accelerator_available",
    "canonical_dtype_for",
    "check_expert_ids",
    "collate_routes",
    "compact_routes",
    "global_layout",
    "plan_microbatches",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_r3' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from torch_r3.client import RemoteGenerateClient, RemoteGenerateError, RemoteGenerateResult, ZeroRoutesWarning
    from torch_r3.codec import (
        WireFormatError,
        base64_decoded_length,
        decode_npy,
        decode_routes,
        decode_sglang_routes,
        decode_vllm_routes,
        encode_routes,
    )
    from torch_r3.trace import RoutedExpertTrace, TokenMetadataTrace
