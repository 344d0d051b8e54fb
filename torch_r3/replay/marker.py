"""One replay hook per router: a marker attribute on the router instance says which hook holds it.

Two hooks on one router would both rewrite its choice (the second replaying on
top of the first), so a hook `claim`s every router it replays when it is built
and `release`s them when it closes. The marker lives in the instance's own
`__dict__`, as `accelerate` marks the modules it hooks, so it never touches the
class and every other model in the process is unaffected.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []  # the hooks' internals

MARKER = "_torch_r3_replay_hook"
"""The attribute an open replay hook sets on each router instance it holds."""


def check_free(module: Any, where: str) -> None:
    """Raise `ValueError` when an open replay hook already holds `module`; `where` names it in the message.

    Examples:
        >>> class Router: pass
        >>> router = Router()
        >>> claim(router, "layer 0")
        >>> check_free(router, "layer 0")
        Traceback (most recent call last):
        ...
        ValueError: layer 0: this router already belongs to an open ReplayHook; close() that hook before building another (one hook per model)
        >>> release(router); check_free(router, "layer 0")
    """
    if vars(module).get(MARKER, False):
        raise ValueError(
            f"{where}: this router already belongs to an open ReplayHook; close() that hook before "
            "building another (one hook per model)"
        )


def claim(module: Any, where: str) -> None:
    """Mark `module` as held by a replay hook (after `check_free`)."""
    check_free(module, where)
    vars(module)[MARKER] = True


def release(module: Any) -> None:
    """Remove the marker `claim` set; nothing happens when there is none."""
    vars(module).pop(MARKER, None)
