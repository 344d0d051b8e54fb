"""Swapping a framework's functions for torch_r3's, and putting every one back: the one mechanism of both integrations.

A framework looks some functions up in their home module at call time and
imports others by name into other modules, under any alias
(`from skyrl.train.dataset.preprocess import make_router_padding_mask as mask_fn`).
`Swaps.everywhere` replaces a function in its home module and in every
binding of the same object in every loaded module, whatever its name; a
module imported later binds the replacement itself. `Swaps.owned` replaces
one attribute of one owner (a class attribute, one module's global).

Each binding is recorded before it is replaced, so `Swaps.undo()` puts back
every binding that holds a replacement: those made at install, those made
after it (a later `import` bound the replacement), and none that a failed
assignment left alone. An `install()` that fails part-way (a read-only module
object, any exception, `KeyboardInterrupt` included) calls `undo()` and every
module is as it was. torch_r3's own modules, and any module that held a
replacement before the swap, keep it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

__all__ = ["Swaps"]

_MISSING = object()


def _own(module_name: str) -> bool:
    return module_name == "torch_r3" or module_name.startswith("torch_r3.")


def _bindings(value: Any) -> list[tuple[Any, str]]:
    """Every `(module, name)` of `sys.modules` whose namespace holds `value` (identity, any name), torch_r3's aside.

    The namespaces are read as they are: no module's lazy `__getattr__` runs.
    """
    found = []
    for key, module in list(sys.modules.items()):
        if _own(key):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, bound in list(namespace.items()):
            if bound is value:
                found.append((module, name))
    return found


def _holds(owner: Any, name: str, value: Any) -> bool:
    return owner.__dict__.get(name, _MISSING) is value


@dataclasses.dataclass
class _Everywhere:
    """One function swapped in every binding: the bindings recorded at install and those kept as they were."""

    original: Any
    replacement: Any
    recorded: list[tuple[Any, str]]
    kept: set[tuple[int, str]]


@dataclasses.dataclass
class _Owned:
    """One attribute swapped on one owner, with what it held before (`_MISSING`: nothing)."""

    owner: Any
    name: str
    previous: Any
    replacement: Any


class Swaps:
    """The swaps of one `install()`: each binding recorded before it is replaced, all undone by `undo()`.

    Attributes:
        swapped: Every swap made, as `module.name` (or `module.Class.name`).

    Examples:
        >>> import sys, types
        >>> home, user = types.ModuleType("home_mod"), types.ModuleType("user_mod")
        >>> home.f = user.g = len  # `from home_mod import f as g` in user_mod
        >>> sys.modules.update(home_mod=home, user_mod=user)
        >>> swaps = Swaps()
        >>> swaps.everywhere(home, "f", abs)
        >>> home.f is user.g is abs
        True
        >>> swaps.undo()
        >>> home.f is user.g is len
        True
        >>> del sys.modules["home_mod"], sys.modules["user_mod"]
    """

    def __init__(self) -> None:
        self._order: list[_Everywhere | _Owned] = []
        self.swapped: list[str] = []

    def everywhere(self, module: Any, name: str, replacement: Any) -> None:
        """Replace `module.name` and every other binding of the same object in every loaded module, any name.

        Raises:
            AttributeError: `module` has no `name`.
            BaseException: whatever a module's assignment raises; the bindings
                replaced so far stay recorded, for `undo()`.
        """
        original = getattr(module, name)
        targets = [(module, name)] + [b for b in _bindings(original) if b != (module, name)]
        kept = {(id(owner), bound) for owner, bound in _bindings(replacement)}
        swap = _Everywhere(original, replacement, [], kept)
        self._order.append(swap)
        self.swapped.append(f"{module.__name__}.{name}")
        for owner, bound in targets:
            swap.recorded.append((owner, bound))
            setattr(owner, bound, replacement)

    def owned(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace `name` on `owner` only (a class attribute, or one module's global; absent before is fine)."""
        swap = _Owned(owner, name, owner.__dict__.get(name, _MISSING), replacement)
        self._order.append(swap)
        label = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        self.swapped.append(f"{label}.{name}")
        setattr(owner, name, replacement)

    def undo(self) -> None:
        """Put back every binding that holds a replacement, newest swap first; a second call does nothing.

        A binding made after the swap (a module imported since) is put back too;
        one whose assignment failed, or that someone changed since, is left as it is.

        Raises:
            Exception: the first error of a module that refused its original
                back, after every other binding was put back.
        """
        order, self._order = self._order, []
        errors: list[Exception] = []
        for swap in reversed(order):
            for owner, name, original in _restores(swap):
                try:
                    if original is _MISSING:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, original)
                except Exception as err:  # the other bindings still go back
                    errors.append(err)
        if errors:
            raise errors[0]


def _restores(swap: _Everywhere | _Owned) -> list[tuple[Any, str, Any]]:
    """The `(owner, name, original)` assignments that undo `swap`: only where its replacement is bound now."""
    if isinstance(swap, _Owned):
        return [(swap.owner, swap.name, swap.previous)] if _holds(swap.owner, swap.name, swap.replacement) else []
    found, seen = [], set()
    for owner, name in swap.recorded + _bindings(swap.replacement):
        key = (id(owner), name)
        if key in seen or key in swap.kept or not _holds(owner, name, swap.replacement):
            continue
        seen.add(key)
        found.append((owner, name, swap.original))
    return found
