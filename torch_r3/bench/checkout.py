"""Where `torch-r3 bench --check-targets` finds the project's targets: `benchmarks/targets.py` of a checkout.

The targets are the project's own pass/fail yardstick, not part of what users
install. A checkout (or an editable install of one) has them beside the
package, in its `benchmarks` package (with the peers' collations the targets
compare with, `benchmarks/peers.py`); an installed wheel does not, and
`--check-targets` then says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["BENCHMARKS_PACKAGE", "TARGETS_MODULE", "TargetsUnavailableError", "load_targets", "targets_path"]

#: The checkout's folder of benchmarks, imported as a package of this name.
BENCHMARKS_PACKAGE = "benchmarks"
#: The name the targets module is imported under.
TARGETS_MODULE = f"{BENCHMARKS_PACKAGE}.targets"


class TargetsUnavailableError(RuntimeError):
    """This torch_r3 is not a checkout: `benchmarks/targets.py` is not beside the package."""


def targets_path() -> Path:
    """Where a checkout keeps the targets: `benchmarks/targets.py` next to the `torch_r3` package."""
    return Path(__file__).resolve().parents[2] / BENCHMARKS_PACKAGE / "targets.py"


def _import_benchmarks(folder: Path) -> None:
    """Make `folder` the `benchmarks` package, unless it is already (as under `python -m benchmarks.compare`)."""
    package = sys.modules.get(BENCHMARKS_PACKAGE)
    if package is None:
        init = folder / "__init__.py"
        if not init.is_file():
            raise TargetsUnavailableError(f"--check-targets needs {init}: this checkout's benchmarks are incomplete")
        spec = importlib.util.spec_from_file_location(
            BENCHMARKS_PACKAGE, init, submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules[BENCHMARKS_PACKAGE] = package
        try:
            spec.loader.exec_module(package)
        except BaseException:
            del sys.modules[BENCHMARKS_PACKAGE]
            raise
    where = [Path(p).resolve() for p in getattr(package, "__path__", ())]
    if folder.resolve() not in where:
        raise TargetsUnavailableError(
            f"--check-targets needs this checkout's {folder}, but another package named {BENCHMARKS_PACKAGE!r} "
            f"is imported ({', '.join(map(str, where)) or 'not a package'})"
        )


def load_targets() -> ModuleType:
    """The targets module of this checkout (imported once, as `benchmarks.targets`).

    Importing it registers the checkout's peers (`benchmarks/peers.py`), which
    the targets compare torch_r3 with.

    Raises:
        TargetsUnavailableError: not a checkout; the message says what is missing.
    """
    path = targets_path()
    if not path.is_file():
        raise TargetsUnavailableError(
            f"--check-targets needs a torch_r3 checkout: the project's targets ({path}) are not part of the "
            f"installed package"
        )
    _import_benchmarks(path.parent)
    return importlib.import_module(TARGETS_MODULE)
