"""Renamed arguments, names and modules: the old spelling keeps working and says what to write instead.

One wording for every rename, so a user who meets two of them reads the same
sentence twice. `RENAMED_KEYWORDS` is the one table of the renamed keyword
arguments (with the value each had when not given), and `warn_external` the one
warning path of the package: a warning is attributed to the user's line, the
stack level computed (`external_stacklevel`), never written by hand. Passing the
old and the new spelling at once is refused.

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
from typing import Any, NamedTuple

__all__ = [
    "MOVED_MODULES",
    "RENAMED_KEYWORDS",
    "RENAMED_NAMES",
    "RenamedKeyword",
    "at_old_default",
    "external_stacklevel",
    "install_module_aliases",
    "moved_module",
    "renamed_name",
    "renamed_argument",
    "warn_external",
    "warn_old_default",
    "warn_renamed",
]


class RenamedKeyword(NamedTuple):
    """Where an old keyword argument went, and the value it had when not given (then it changes nothing)."""

    new: str
    """The argument that holds it now: `"layout"` or `"memory"` (a field of that value), or the new keyword."""
    field: str | None
    """The field of the `layout=` / `memory=` value it became (`None`: the new keyword itself, or `packed=`'s class)."""
    old_default: Any
    """Its default value before the rename."""


#: Every renamed keyword argument: old keyword -> where it went and its old default. Which function took
#: which of them is each function's own list (a keyword it never had is a `TypeError`).
RENAMED_KEYWORDS: dict[str, RenamedKeyword] = {
    "padding": RenamedKeyword("filler", None, "arange"),
    "layers": RenamedKeyword("keep_layers", None, None),
    "max_cached_bytes": RenamedKeyword("cache_bytes", None, None),
    "padding_side": RenamedKeyword("layout", "side", "left"),
    "pad_to_multiple_of": RenamedKeyword("layout", "pad_to_multiple_of", None),
    "seq_len": RenamedKeyword("layout", "seq_len", None),
    "prompt_width": RenamedKeyword("layout", "prompt_width", None),
    "response_width": RenamedKeyword("layout", "response_width", None),
    "prompt_length_key": RenamedKeyword("layout", "prompt_length_key", "prompt_length"),
    "packed": RenamedKeyword("layout", None, False),  # SkyRL's microbatch: True meant torch_r3.Packed
    "workers": RenamedKeyword("memory", "workers", None),
    "pin_memory": RenamedKeyword("memory", "pin_memory", None),
    "cache_bytes": RenamedKeyword("memory", "cache_bytes", None),
    "buffers": RenamedKeyword("memory", "buffers", None),
    "max_output_bytes": RenamedKeyword("memory", "max_output_bytes", None),
    # RemoteGenerateClient's transport options, one value since 0.3.0 (the defaults are TransportConfig's).
    "retries": RenamedKeyword("transport_config", "retries", 5),
    "backoff": RenamedKeyword("transport_config", "backoff", 0.5),
    "max_backoff": RenamedKeyword("transport_config", "max_backoff", 10.0),
    "timeout": RenamedKeyword("transport_config", "timeout", 600.0),
    "connect_timeout": RenamedKeyword("transport_config", "connect_timeout", 30.0),
    "max_concurrency": RenamedKeyword("transport_config", "max_concurrency", 64),
    "max_response_bytes": RenamedKeyword("transport_config", "max_response_bytes", 1 << 30),
    "headers": RenamedKeyword("transport_config", "headers", None),
    "session": RenamedKeyword("transport_config", "session", None),
    "ssl": RenamedKeyword("transport_config", "ssl", True),
    "trace_configs": RenamedKeyword("transport_config", "trace_configs", None),
}


#: Every renamed public name: old dotted name -> new dotted name. An entry ending in `.*` covers every
#: name of a renamed module's namespace. Read through `renamed_name` by the old module's `__getattr__`.
RENAMED_NAMES: dict[str, str] = {
    "torch_r3.BatchLayout": "torch_r3.BatchGeometry",
    "torch_r3.global_layout": "torch_r3.global_geometry",
    "torch_r3.collate.layout.BatchLayout": "torch_r3.collate.geometry.BatchGeometry",
    "torch_r3.collate.layout.global_layout": "torch_r3.collate.geometry.global_geometry",
    "torch_r3.collate.layout.padded_length": "torch_r3.collate.geometry.padded_length",
    "torch_r3.rollout.protocols.torch_r3.*": "torch_r3.rollout.protocols.native.*",
}


def renamed_name(module: str, name: str) -> Any:
    """The object the old name `module.name` (`RENAMED_NAMES`) stands for, after a `DeprecationWarning` naming it.

    Raises:
        AttributeError: `module.name` is no renamed name (or its new home lacks it), as a module's would.
    """
    old = f"{module}.{name}"
    new = RENAMED_NAMES.get(old)
    if new is None and not name.startswith("__"):
        wildcard = RENAMED_NAMES.get(f"{module}.*")
        new = None if wildcard is None else wildcard[:-1] + name
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, _, attr = new.rpartition(".")
    # The new home is loaded by then (importing it here could close a circle during the package's import).
    value = getattr(sys.modules[home] if home in sys.modules else importlib.import_module(home), attr)
    warn_renamed(old, new)
    return value


def at_old_default(keyword: str, value: Any) -> bool:
    """Whether `value` is the old default of the renamed `keyword`: passing it meant nothing then either.

    Examples:
        >>> at_old_default("padding_side", "left"), at_old_default("padding_side", "right")
        (True, False)
    """
    default = RENAMED_KEYWORDS[keyword].old_default
    if value is default:
        return True
    return type(value) is type(default) and isinstance(value, (str, int)) and value == default


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
        warn_external(
            f"{spec.name} moved to {self.new} in torch_r3 0.3.0; import {self.new} instead (the old path goes in 0.4.0)"
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


def warn_external(message: str, category: type[Warning] = DeprecationWarning, *, stacklevel: int | None = None) -> None:
    """The package's one warning path: `message` attributed to the first line outside torch_r3.

    `stacklevel` overrides the computed level, for a warning raised where the
    user's line is not on the stack (a helper thread): as `warnings.warn`'s,
    counted from the caller of this function.
    """
    level = external_stacklevel() if stacklevel is None else stacklevel + 1
    warnings.warn(message, category, stacklevel=level)


def warn_renamed(old: str, new: str, *, stacklevel: int | None = None) -> None:
    """Warn that `old` is deprecated in favour of `new` (both as the user writes them), on the user's line.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_renamed("collate_routes(padding=)", "filler=")
        >>> str(seen[0].message)
        'collate_routes(padding=) is deprecated; use filler= instead (same meaning)'
    """
    level = None if stacklevel is None else stacklevel + 1
    warn_external(f"{old} is deprecated; use {new} instead (same meaning)", stacklevel=level)


def warn_old_default(where: str, keyword: str, value: Any) -> None:
    """Warn that `where(keyword=value)` is deprecated and, at its old default value, changes nothing."""
    warn_external(f"{where}({keyword}={value!r}) is deprecated and changes nothing at its old default value: drop it")


def renamed_argument(
    old_value: Any,
    new_value: Any,
    *,
    old: str,
    new: str,
    where: str,
    default: Any = None,
    stacklevel: int | None = None,
) -> Any:
    """The value of an argument that was renamed from `old` to `new` in `where`.

    `old_value` is `None` when the caller did not pass the old spelling; then
    `new_value` is the answer. Otherwise a `DeprecationWarning` is issued (on
    the user's line: the first frame outside torch_r3) and `old_value` is the
    answer, unless the caller passed `new` as well (a `TypeError`).

    Raises:
        TypeError: When both spellings are given.
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated spelling), not both")
    warn_renamed(f"{where}({old}=)", f"{new}=", stacklevel=None if stacklevel is None else stacklevel + 1)
    return old_value
