"""Swapping verl's names for `install()`, and putting every one of them back.

A function is swapped where it is defined and wherever a module bound it by
name (`from verl... import f`, under any alias), at install; at uninstall every
binding of the replacement is put back, also in modules imported after
install (they bound the replacement). A class attribute or a single module's
name (one owner) is swapped on that owner only.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Swaps"]

_MISSING = object()


def _bindings(value: Any) -> list[tuple[Any, str]]:
    """Every `(module, name)` in `sys.modules` whose attribute is `value` (identity), torch_r3's own modules aside."""
    found = []
    for key, module in list(sys.modules.items()):
        if key == "torch_r3" or key.startswith("torch_r3."):  # where the replacements are defined
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, bound in list(namespace.items()):
            if bound is value:
                found.append((module, name))
    return found


class Swaps:
    """The names one `install()` replaced, undone together by `undo()` (in reverse order)."""

    def __init__(self) -> None:
        self._everywhere: list[tuple[Any, Any]] = []  # (original, replacement)
        self._owned: list[tuple[Any, str, Any]] = []  # (owner, name, original or _MISSING)
        self.names: list[str] = []

    def everywhere(self, module: Any, name: str, replacement: Any) -> None:
        """Replace `module.name` and every other binding of the same object, in every loaded module."""
        original = getattr(module, name)
        for owner, bound_name in _bindings(original):
            setattr(owner, bound_name, replacement)
        self._everywhere.append((original, replacement))
        self.names.append(f"{module.__name__}.{name}")

    def owned(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace `name` on `owner` only (a class attribute, or one module's global)."""
        namespace = owner.__dict__
        self._owned.append((owner, name, namespace.get(name, _MISSING)))
        setattr(owner, name, replacement)
        label = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        self.names.append(f"{label}.{name}")

    def undo(self) -> None:
        """Put every original back, including bindings made after the swap; a second call does nothing."""
        for owner, name, original in reversed(self._owned):
            if original is _MISSING:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        for original, replacement in reversed(self._everywhere):
            for owner, bound_name in _bindings(replacement):
                setattr(owner, bound_name, original)
        self._owned.clear()
        self._everywhere.clear()
