"""Routed-expert replay (R3) plumbing for PyTorch and Megatron RL trainers.

The top level holds what the guides teach: the collators and their layout, the
route-array helpers, the wire codec, the trace and the client. Everything else
is reached through its module, and the API reference documents exactly each
module's `__all__`. `import torch_r3` stays quick and imports neither Megatron
nor aiohttp: the client, codec and trace names are resolved on first use, and
the Megatron hook lives in `torch_r3.megatron`. A part whose optional dependency is missing says
which extra installs it (`pip install 'torch_r3[megatron]'`, `'torch_r3[client]'`).
"""

from __future__ import annotations

import importlib as _importlib
import logging as _logging
import typing as _typing

from torch_r3 import _deprecation
from torch_r3.collate import R3Collator, collate_routes
from torch_r3.collate._buffers import BufferPool
from torch_r3.collate.geometry import BatchGeometry, global_geometry
from torch_r3.collate.layout import Memory, Packed, Padded, PromptResponse
from torch_r3.collate.nested import as_nested
from torch_r3.collate.shard import ShardCollator, plan_microbatches
from torch_r3.routes import check_expert_ids, compact_routes

__version__ = "0.3.0"

# The import paths 0.3.0 moved into the stage folders keep importing for one release, with a warning.
_deprecation.install_module_aliases()

_logging.getLogger(__name__).addHandler(_logging.NullHandler())  # silent unless the application configures logging

# name -> module that defines it; imported lazily (PEP 562) so that the core
# import never pulls in aiohttp. Like the eager names above, these are the names
# the guides teach; the rest of each module is reached through its module.
_LAZY: dict[str, str] = {
    "encode_routes": "torch_r3.rollout.codec",
    "decode_routes": "torch_r3.rollout.codec",
    "decode_sglang_routes": "torch_r3.rollout.codec",
    "decode_vllm_routes": "torch_r3.rollout.codec",
    "WireFormatError": "torch_r3.errors",
    "RoutedExpertTrace": "torch_r3.rollout.trace",
    "RemoteGenerateClient": "torch_r3.rollout.client",
    "RemoteGenerateResult": "torch_r3.rollout.client",
    "RemoteGenerateError": "torch_r3.errors",
    "ZeroRoutesWarning": "torch_r3.rollout.client",
}

# Written out (not built from _LAZY) so that type checkers and linters read the surface.
__all__ = [
    "BatchGeometry",
    "BufferPool",
    "Memory",
    "Packed",
    "Padded",
    "PromptResponse",
    "R3Collator",
    "RemoteGenerateClient",
    "RemoteGenerateError",
    "RemoteGenerateResult",
    "RoutedExpertTrace",
    "ShardCollator",
    "WireFormatError",
    "ZeroRoutesWarning",
    "as_nested",
    "check_expert_ids",
    "collate_routes",
    "compact_routes",
    "decode_routes",
    "decode_sglang_routes",
    "decode_vllm_routes",
    "encode_routes",
    "global_geometry",
    "plan_microbatches",
]


def __getattr__(name: str) -> _typing.Any:
    if f"torch_r3.{name}" in _deprecation.RENAMED_NAMES:  # deprecated top-level names
        return _deprecation.renamed_name("torch_r3", name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_r3' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public face: the names of `__all__`, the public submodules loaded so far and the module's dunders."""
    names = set(globals()) | set(_LAZY)
    return sorted(n for n in names if not n.startswith("_") or (n.startswith("__") and n.endswith("__")))


if _typing.TYPE_CHECKING:  # pragma: no cover
    from torch_r3.errors import RemoteGenerateError, WireFormatError
    from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateResult, ZeroRoutesWarning
    from torch_r3.rollout.codec import (
        decode_routes,
        decode_sglang_routes,
        decode_vllm_routes,
        encode_routes,
    )
    from torch_r3.rollout.trace import RoutedExpertTrace

del annotations  # the `from __future__` flag: no name of the package
