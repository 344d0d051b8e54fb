"""Renamed arguments, names and modules: the old spelling keeps working and says what to write instead.

One wording for every rename, so a user who meets two of them reads the same
sentence twice. A `DeprecationWarning` is attributed to the user's line: the
stack level is computed (`external_stacklevel`), never written by hand, and
passing the old and the new spelling at once is refused.

`MOVED_MODULES` is the one table of the import paths that 0.3.0 moved into the
stage folders (`torch_r3.rollout`, `torch_r3.collate`, `torch_r3.health`,
`torch_r3.replay`). `install_module_aliases` puts a finder on `sys.meta_path`
that answers an old path with the very module object of the new one, after one
`DeprecationWarning` naming the new path; `import torch_r3` installs it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MOVED_MODULES",
    "external_stacklevel",
    "install_module_aliases",
    "moved_module",
    "renamed_argument",
    "warn_renamed",
]

#: Old import path -> its home since 0.3.0. A package's entry covers its submodules too
#: (`torch_r3.protocols.sglang` -> `torch_r3.rollout.protocols.sglang`). Kept for one release.
MOVED_MODULES: dict[str, str] = {
    "torch_r3.client": "torch_r3.rollout.client",
    "torch_r3.transport": "torch_r3.rollout.transport",
    "torch_r3.codec": "torch_r3.rollout.codec",
    "torch_r3.trace": "torch_r3.rollout.trace",
    "torch_r3.inprocess": "torch_r3.rollout.inprocess",
    "torch_r3.protocols": "torch_r3.rollout.protocols",
    "torch_r3.layout": "torch_r3.collate.layout",
    "torch_r3.geometry": "torch_r3.collate.geometry",
    "torch_r3.shard": "torch_r3.collate.shard",
    "torch_r3.nested": "torch_r3.collate.nested",
    "torch_r3.stats": "torch_r3.replay.stats",
    "torch_r3.indexer.encoding": "torch_r3.selections",
    "torch_r3.indexer.wire": "torch_r3.rollout.selections_wire",
    "torch_r3.indexer.turns": "torch_r3.rollout.selections_trace",
    "torch_r3.indexer.collate": "torch_r3.collate.selections",
    "torch_r3.indexer.checks": "torch_r3.replay.selection_checks",
    "torch_r3.indexer.stats": "torch_r3.replay.selection_stats",
    "torch_r3.indexer.transformers": "torch_r3.transformers.indexer",
    "torch_r3.integrations.skyrl.swap": "torch_r3.integrations.skyrl.install",
}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _importlib_frame(filename: str) -> bool:
    # The frames `warnings.warn` itself leaves out of its count (CPython's `_is_internal_frame`).
    return "importlib" in filename and "_bootstrap" in filename


def _internal(filename: str) -> bool:
    # torch_r3's own frames and the import machinery's are skipped: the warning belongs to the user's line.
    return (
        filename.startswith(_PACKAGE_DIR)
        or _importlib_frame(filename)
        or filename.endswith(os.path.join("importlib", "__init__.py"))
    )


def external_stacklevel() -> int:
    """The `stacklevel` that attributes a warning issued by the calling function to the first frame outside torch_r3.

    Frames of torch_r3 itself and of `importlib` are skipped, so a rename
    reached through any number of internal calls is reported on the user's line.
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        # `warnings.warn` itself leaves the import machinery's frames out of its count.
        if not _importlib_frame(frame.f_code.co_filename):
            level += 1
    return level


def moved_module(name: str) -> str | None:
    """The new path of an import path that 0.3.0 moved, or `None` when `name` did not move.

    Examples:
        >>> moved_module("torch_r3.protocols.sglang")
        'torch_r3.rollout.protocols.sglang'
        >>> moved_module("torch_r3.collate") is None
        True
    """
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the very module object of its new path."""

    def __init__(self, new: str) -> None:
        self.new = new
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new} in torch_r3 0.3.0; import {self.new} instead (the old path goes in 0.4.0)",
            DeprecationWarning,
            stacklevel=external_stacklevel(),
        )
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system set the alias's spec on the shared module; give it back its own.
        module.__spec__ = self._spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("torch_r3."):
            return None
        new = moved_module(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


_FINDER = _MovedModuleFinder()


def install_module_aliases() -> None:
    """Answer the moved import paths (idempotent). First on `sys.meta_path`: a moved package's old submodule
    path must reach the alias, not be loaded a second time from the new package's folder."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new` (both as the user writes them).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_renamed("collate_routes(padding=)", "filler=", stacklevel=1)
        >>> str(seen[0].message)
        'collate_routes(padding=) is deprecated; use filler= instead (same meaning)'
    """
    warnings.warn(f"{old} is deprecated; use {new} instead (same meaning)", DeprecationWarning, stacklevel=stacklevel)


def renamed_argument(
    old_value: Any, new_value: Any, *, old: str, new: str, where: str, default: Any = None, stacklevel: int = 4
) -> Any:
    """The value of an argument that was renamed from `old` to `new` in `where`.

    `old_value` is `None` when the caller did not pass the old spelling; then
    `new_value` is the answer. Otherwise a `DeprecationWarning` is issued (on
    the caller's caller's line, or `stacklevel` frames up) and `old_value` is the answer, unless the caller
    passed `new` as well (a `TypeError`).

    Raises:
        TypeError: When both spellings are given.
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated spelling), not both")
    warn_renamed(f"{where}({old}=)", f"{new}=", stacklevel=stacklevel)
    return old_value
