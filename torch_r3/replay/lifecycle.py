"""The lifecycle the transformers-side replay hooks share: open once built, one block at a time, closed for good.

A hook holds some modules of a model (the routers, the indexers): it claims
each one with the one-hook-per-module marker when it is built, registers its
forward hooks on them, and runs one `replay()` or `record()` block at a time;
`close()` removes its hooks, releases the markers and restores whatever else
it changed, after which the hook refuses every block. `HookLifecycle` is that
life, written once for `torch_r3.transformers.ReplayHook` and
`torch_r3.indexer.IndexerReplayHook`. It imports no framework.

A subclass, in its `__init__`:

- calls `self._hold(pairs)` with `(module, name)` pairs: every module is
  checked free before any is claimed, so a refused hook claims nothing;
- sets `self._active` and `self._recording` to `None` (the block running now,
  if any) and `self._handles` to its hook handles (anything with `.remove()`);
- overrides `_restore()` when closing must undo more than its handles and markers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from torch_r3.replay import marker

__all__: list[str] = []  # the hooks' internals

_Hook = TypeVar("_Hook", bound="HookLifecycle")


class HookLifecycle:
    """Base of a replay hook that holds modules: `close()`, the context manager, and the one-block-at-a-time rule."""

    _handles: list[Any]
    _held: list[Any]
    _active: Any
    _recording: Any

    def _hold(self, pairs: Iterable[tuple[Any, str]]) -> None:
        """Claim each `(module, name)` for this hook, after checking that no open hook holds any of them."""
        pairs = list(pairs)
        for module, name in pairs:
            marker.check_free(module, name)
        for module, name in pairs:
            marker.claim(module, name)
        self._held = [module for module, _ in pairs]

    def close(self) -> None:
        """Remove the hooks; the model is as it was before the hook.

        The hook is also a context manager: `with hook:` closes it on the way out.
        Closing twice is harmless.
        """
        for handle in self._handles:
            handle.remove()
        if self._handles:
            for module in self._held:
                marker.release(module)
        self._restore()
        self._handles = []
        self._active = None

    def __enter__(self: _Hook) -> _Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restore(self) -> None:
        """What closing undoes besides the hook handles and the markers; nothing here."""

    def _check_idle(self) -> None:
        """Refuse a block on a closed hook, or one inside another block."""
        name = type(self).__name__
        if not self._handles:
            raise RuntimeError(f"{name} is closed")
        if self._active is not None or self._recording is not None:
            raise RuntimeError(f"{name}: replay() and record() blocks do not nest")
