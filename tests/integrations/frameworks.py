"""Load SkyRL's and verl's own modules from their installed wheels, skipping heavy package `__init__`s.

`make test` installs `skyrl==0.4.0` and `verl==0.9.1` into `.venv-frameworks`
(`--no-deps --ignore-requires-python`, plus the light dependencies the modules
below import). Three parent packages cannot be imported there, and are
registered here as bare package objects with the wheel's own `__path__`, so that
the import system then loads the real submodule files from the wheel (no copy
of their code lives in this repository):

* `skyrl.train`, `skyrl.train.dataset`: their `__init__`s import
  `PromptDataset` and through it `datasets`; `skyrl.backends` imports the Tinker
  backend; `skyrl.backends.skyrl_train.utils` imports its IO helpers (cloud storage).
* `verl` and the `verl.*` packages on the way to the modules used: `verl/__init__.py`
  imports `DataProto`, and with it Ray; `verl.utils` imports the tokenizer and
  config helpers (hydra).

What is then imported is exactly the wheel's code: `preprocess`,
`training_batch`, `packed_tensor`, `replay_utils`, `token_metadata` (SkyRL);
`workers/utils/padding.py`, `utils/megatron/router_replay_utils.py` and what
they import (verl).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import pytest

SKYRL_VERSION = "0.4.0"
VERL_VERSION = "0.9.1"

_BARE = {
    "skyrl": ["skyrl.backends", "skyrl.train", "skyrl.train.dataset", "skyrl.backends.skyrl_train.utils"],
    "verl": [
        "verl",
        "verl.utils",
        "verl.workers",
        "verl.workers.utils",
        "verl.models",
        "verl.models.mcore",
        "verl.utils.megatron",
    ],
}


def _bare(name: str, root: Path) -> None:
    if name in sys.modules:
        return
    path = str(root.joinpath(*name.split(".")[1:]))
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = spec
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(importlib.import_module(parent), child, module)


def installed(framework: str) -> bool:
    """Whether `framework`'s wheel is installed here (found, not imported: verl's `__init__` needs Ray)."""
    return importlib.util.find_spec(framework) is not None


def requires(framework: str) -> pytest.MarkDecorator:
    """Skip unless `framework` is installed (`make frameworks` builds `.venv-frameworks` with both)."""
    return pytest.mark.skipif(
        not installed(framework),
        reason=f"{framework} is not installed here; `make frameworks` builds .venv-frameworks with it",
    )


def installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def load(framework: str, *modules: str) -> list[types.ModuleType]:
    """Import `modules` from the installed `framework` ("skyrl" or "verl") behind bare parents."""
    spec = importlib.util.find_spec(framework)  # a top-level find does not run the package's __init__
    assert spec is not None and spec.submodule_search_locations, framework
    root = Path(list(spec.submodule_search_locations)[0])
    for name in _BARE[framework]:
        _bare(name, root)
    return [importlib.import_module(m) for m in modules]


WORKER_DEPENDENCIES = ("ray", "pandas", "requests")
"""What SkyRL 0.4.0's Megatron model wrapper imports at module level beyond the light set above
(`ppo_utils` imports Ray and declares a Ray actor; `skyrl.train.config` imports `skyrl_gym`, whose
tools import pandas and requests). `make frameworks` installs them."""

MISSING_BRIDGE_NAMES = ("enable_expert_parallel_grad_sync_in_finalize", "finalize_model_grads_with_expert_adapter_sync")
"""What `megatron_model_wrapper.py` imports from `megatron.bridge.peft.utils`: no released megatron-bridge
(0.6.2 is the newest) defines them; SkyRL 0.4.0 runs against Megatron-Bridge's unreleased main."""


def _bridge_stand_in() -> None:
    """`megatron.bridge.peft.utils` with the two grad-sync names only, for a model without LoRA adapters.

    Neither is on the replay path: the wrapper's constructor calls the first on its model chunks (it
    removes per-micro-batch hooks of shared-expert LoRA adapters; a model without adapters has none,
    and the stand-in refuses one that has), the second runs only in `run_pending_grad_sync`, at
    `optim_step`, which the tests do not call (it raises if called).
    """
    if "megatron.bridge.peft.utils" in sys.modules:
        return

    def enable(model_chunks):
        for chunk in model_chunks:
            names = [n for n, _ in chunk.named_modules() if "adapter" in n.lower()]
            if names:
                raise NotImplementedError(f"stand-in for megatron-bridge: the model has LoRA adapters {names[:3]}")

    def finalize(*args, **kwargs):
        raise NotImplementedError("stand-in for megatron-bridge: the grad sync at optim_step is not run here")

    for name in ("megatron.bridge", "megatron.bridge.peft"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    utils = types.ModuleType("megatron.bridge.peft.utils")
    utils.enable_expert_parallel_grad_sync_in_finalize = enable
    utils.finalize_model_grads_with_expert_adapter_sync = finalize
    sys.modules["megatron.bridge.peft.utils"] = utils


def requires_skyrl_worker() -> pytest.MarkDecorator:
    """Skip unless SkyRL and what its Megatron model wrapper imports are installed."""
    missing = [m for m in ("skyrl", "megatron", *WORKER_DEPENDENCIES) if not installed(m)]
    return pytest.mark.skipif(
        bool(missing), reason=f"not installed here: {missing}; `make frameworks` builds .venv-frameworks with them"
    )


def load_skyrl_worker(*modules: str) -> list[types.ModuleType]:
    """`load("skyrl", ...)` for SkyRL's Megatron worker modules.

    The wheel ships `skyrl_gym` in its `skyrl-gym/` folder (a pip user gets it as the `skyrl-gym`
    distribution, SkyRL's `skyrl-train` extra): that folder goes on the path. `megatron.bridge.peft.utils`
    is `_bridge_stand_in`'s.
    """
    spec = importlib.util.find_spec("skyrl")
    assert spec is not None and spec.submodule_search_locations
    gym = Path(list(spec.submodule_search_locations)[0]).parent / "skyrl-gym"
    if gym.is_dir() and str(gym) not in sys.path:
        sys.path.append(str(gym))
    _bridge_stand_in()
    return load("skyrl", *modules)


# What verl 0.9.1's engine module and agent loop import beyond the modules `load` reaches: its
# declared dependencies (Ray, Peft, hydra) and three it imports without declaring them.
_FULL_VERL = ("ray", "peft", "hydra", "codetiming", "cachetools", "uvicorn", "fastapi")


def requires_full_verl() -> pytest.MarkDecorator:
    """Skip unless verl is installed with its dependencies (`make test` builds `.venv-verl` with them)."""
    missing = [m for m in _FULL_VERL if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        not installed("verl") or bool(missing),
        reason=f"verl's engine and agent loop need verl installed with its dependencies (missing: "
        f"{', '.join(missing) or 'verl'}); `make test` builds .venv-verl with them",
    )
