"""Deprecated module name: torch_r3's own server format lives in `torch_r3.rollout.protocols.native`.

Reading a name from here (`torch_r3.rollout.protocols.torch_r3.GENERATE_PATH`) still works and warns.
"""

from __future__ import annotations

from typing import Any

from torch_r3._deprecation import renamed_name
from torch_r3.rollout.protocols import native  # noqa: F401  (loaded: the renamed names' home)

__all__: list[str] = []


def __getattr__(name: str) -> Any:
    return renamed_name(__name__, name)  # an AttributeError names the attribute, as a module's would
