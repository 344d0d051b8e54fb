"""Module-attribute swaps that follow names imported elsewhere: what every `install()` here is made of.

SkyRL looks some functions up in their module at call time
(`preprocess._collate_rollout_expert_indices`) and imports others by name into
other modules (`from ...preprocess import make_router_padding_mask` in
`skyrl.train.trainer`, `from ...replay_utils import
setup_per_microbatch_replay_forward` in the Megatron model wrapper). A `Swap`
replaces the function in its home module and in every loaded module that bound
the same object under the same name, before `install()`; a module imported
after `install()` binds the replacement itself. `restore()` puts the original
back everywhere the replacement is found then (but in `torch_r3`'s own modules,
and those that held it before), so both cases are undone.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

__all__ = ["Swap", "UnsupportedSkyRL", "skyrl_version"]


class UnsupportedSkyRL(RuntimeError):
    """SkyRL's module lacks a function the integration replaces: another SkyRL release than the one tested."""


def skyrl_version() -> str:
    """The installed SkyRL distribution's version, or `"unknown"`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("skyrl")
    except PackageNotFoundError:
        return "unknown"


def _bindings(name: str, value: object) -> list[ModuleType]:
    """Every loaded module whose own namespace holds `value` under `name` (no lazy `__getattr__` run)."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(name, None) is value:
            found.append(module)
    return found


class Swap:
    """Replace functions of one SkyRL module, and their by-name imports, until `restore()`.

    Args:
        module: SkyRL's module that defines the functions.
        replacements: name -> replacement. Every name must exist in `module`.
        follow_imports: Also replace the names in other loaded modules that
            imported the same object (and restore those imported later).

    Raises:
        UnsupportedSkyRL: `module` lacks one of the names (nothing is swapped).
    """

    def __init__(self, module: ModuleType, replacements: Mapping[str, Any], *, follow_imports: bool = True) -> None:
        missing = [name for name in replacements if name not in vars(module)]
        if missing:
            raise UnsupportedSkyRL(
                f"{module.__name__} has no {', '.join(missing)}: torch_r3.integrations.skyrl replaces SkyRL "
                f"0.4.0's functions of that name, and the installed SkyRL is {skyrl_version()}; nothing was swapped"
            )
        self.module = module
        self.names = tuple(replacements)
        self._follow = follow_imports
        self._pairs = {name: (getattr(module, name), value) for name, value in replacements.items()}
        # Modules that hold a replacement already (torch_r3's own, where it is defined) keep it.
        self._keep = {name: {id(m) for m in _bindings(name, value)} for name, value in replacements.items()}
        for name, (original, value) in self._pairs.items():
            targets = _bindings(name, original) if follow_imports else [module]
            if module not in targets:
                targets.append(module)
            for target in targets:
                setattr(target, name, value)

    def restore(self) -> None:
        """Put the originals back wherever the replacements are bound now; a second call does nothing."""
        pairs, self._pairs = self._pairs, {}
        for name, (original, value) in pairs.items():
            targets = _bindings(name, value) if self._follow else [self.module]
            for target in targets:
                if id(target) not in self._keep[name] and not target.__name__.startswith("torch_r3."):
                    setattr(target, name, original)
