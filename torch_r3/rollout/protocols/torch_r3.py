"""Deprecated module name: torch_r3's own server format lives in `torch_r3.rollout.protocols.native`.

Reading a name from here (`torch_r3.rollout.protocols.torch_r3.GENERATE_PATH`) still works and warns.
"""

from __future__ import annotations

from typing import Any

from torch_r3._deprecation import warn_renamed
from torch_r3.rollout.protocols import native

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(native, name)  # an AttributeError names the attribute, as a module's would
    warn_renamed(f"torch_r3.rollout.protocols.torch_r3.{name}", f"torch_r3.rollout.protocols.native.{name}")
    return value
