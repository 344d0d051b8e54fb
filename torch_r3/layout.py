"""Deprecated module name: the batch geometry lives in `torch_r3.geometry` (`BatchGeometry`, `global_geometry`).

`torch_r3.layout.BatchLayout`, `global_layout` and `padded_length` keep
working and warn; `layout=` is the name of the padded/packed mode, so the
geometry object took another word.
"""

from __future__ import annotations

from typing import Any

from torch_r3 import geometry
from torch_r3._deprecation import warn_renamed

__all__: list[str] = []

_RENAMED = {"BatchLayout": "BatchGeometry", "global_layout": "global_geometry", "padded_length": "padded_length"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'torch_r3.layout' has no attribute {name!r}")
    warn_renamed(f"torch_r3.layout.{name}", f"torch_r3.geometry.{new}")
    return getattr(geometry, new)
