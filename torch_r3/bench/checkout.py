"""Where `torch-r3 bench --check-targets` finds the project's targets: `benchmarks/targets.py` of a checkout.

The targets are the project's own pass/fail yardstick, not part of what users
install. A checkout (or an editable install of one) has them beside the
package; an installed wheel does not, and `--check-targets` then says so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["TARGETS_MODULE", "TargetsUnavailableError", "load_targets", "targets_path"]

#: The name the targets module is imported under.
TARGETS_MODULE = "torch_r3_checkout_targets"


class TargetsUnavailableError(RuntimeError):
    """This torch_r3 is not a checkout: `benchmarks/targets.py` is not beside the package."""


def targets_path() -> Path:
    """Where a checkout keeps the targets: `benchmarks/targets.py` next to the `torch_r3` package."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "targets.py"


def load_targets() -> ModuleType:
    """The targets module of this checkout (imported once).

    Raises:
        TargetsUnavailableError: not a checkout; the message says what is missing.
    """
    if TARGETS_MODULE in sys.modules:
        return sys.modules[TARGETS_MODULE]
    path = targets_path()
    if not path.is_file():
        raise TargetsUnavailableError(
            f"--check-targets needs a torch_r3 checkout: the project's targets ({path}) are not part of the "
            f"installed package"
        )
    spec = importlib.util.spec_from_file_location(TARGETS_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[TARGETS_MODULE] = module
    spec.loader.exec_module(module)
    return module
