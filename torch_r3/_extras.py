"""Optional dependencies: import one, or say which extra installs it.

`torch_r3` needs only torch and NumPy. The client and the test server need
aiohttp (the `client` and `testing` extras), the Megatron hook needs
megatron-core (the `megatron` extra). A module that needs one imports it through
`require`, so a user without it reads the command that fixes it instead of a
bare `ModuleNotFoundError`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]

# The distribution that provides each optional top-level module, for the message.
_DISTRIBUTIONS = {"aiohttp": "aiohttp", "megatron": "megatron-core", "matplotlib": "matplotlib"}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it.

    A subclass of `ModuleNotFoundError`, so `except ImportError` still catches it.
    `distribution` is what pip installs (e.g. `"megatron-core"`), `extra` the
    `torch_r3` extra that brings it in (e.g. `"megatron"`).
    """

    def __init__(self, distribution: str, extra: str, *, name: str | None = None) -> None:
        super().__init__(f"{distribution} is not installed: pip install 'torch_r3[{extra}]'", name=name)
        self.distribution = distribution
        self.extra = extra


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise `MissingExtraError` naming `pip install 'torch_r3[extra]'`.

    Only a missing `module` (or its top-level package) is translated; any other
    import error inside an installed dependency propagates unchanged, since
    installing the extra would not fix it.

    Args:
        module: the dotted module name, e.g. `"megatron.core"` or `"aiohttp"`.
        extra: the `torch_r3` extra that installs it, e.g. `"megatron"`.

    Returns:
        The imported module.

    Raises:
        MissingExtraError: `module` or a parent package of it is not installed.

    Examples:
        >>> require("json", "client").__name__
        'json'
        >>> require("no_such_module_r3", "client")
        Traceback (most recent call last):
        ...
        torch_r3._extras.MissingExtraError: no_such_module_r3 is not installed: pip install 'torch_r3[client]'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        parts = module.split(".")
        parents = {".".join(parts[: i + 1]) for i in range(len(parts))}
        if e.name not in parents:
            raise
        raise MissingExtraError(_DISTRIBUTIONS.get(parts[0], parts[0]), extra, name=e.name) from e
