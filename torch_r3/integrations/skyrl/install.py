"""`install()`: one call that swaps `torch_r3` into both sides of SkyRL 0.4.0's training step.

* Controller (`skyrl/train/dataset/preprocess.py`): `_collate_rollout_expert_indices`
  and `make_router_padding_mask` become `controller.collate_rollout_expert_indices`
  and `controller.make_router_padding_mask`.
* Megatron worker (`skyrl/backends/skyrl_train/utils/replay_utils.py`):
  `setup_per_microbatch_replay_forward`, `setup_per_microbatch_replay_backward`,
  `router_replay_schedule` and `patch_topk_router_layer_number` become
  `replay.SkyRLWorkerReplay`'s, and `MegatronModelWrapper`'s schedule lookup
  (`get_forward_backward_func` in `megatron_model_wrapper.py`) runs each
  replaying schedule as one `torch_r3.megatron.ReplayHook` step.

Every name is replaced in SkyRL's module and in each module that imported it,
under any name, before or after `install()`; `Installed.uninstall()` restores
all of them, and an `install()` that fails part-way leaves every module as it
was (`torch_r3.integrations.swap.Swaps`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from torch_r3.collate.layout import Memory, from_keywords
from torch_r3.integrations.skyrl import controller
from torch_r3.integrations.skyrl.replay import MODEL_WRAPPER, REPLAY_UTILS, SCHEDULE_LOOKUP, SkyRLWorkerReplay
from torch_r3.integrations.swap import Swaps

__all__ = ["WORKER_NAMES", "Installed", "Swap", "UnsupportedSkyRL", "install", "skyrl_version"]

WORKER_NAMES = (
    "setup_per_microbatch_replay_forward",
    "setup_per_microbatch_replay_backward",
    "router_replay_schedule",
    "patch_topk_router_layer_number",
)
"""The functions of SkyRL's `replay_utils` that `install(worker=True)` replaces."""

_current: list[Installed] = []  # the handle installed now, if any: a second install() is refused


class UnsupportedSkyRL(RuntimeError):
    """SkyRL's module lacks a function the integration replaces: another SkyRL release than the one tested."""


def skyrl_version() -> str:
    """The installed SkyRL distribution's version, or `"unknown"`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("skyrl")
    except PackageNotFoundError:
        return "unknown"


class Swap(Swaps):
    """Replace functions of one SkyRL module, and every binding of them in other loaded modules, until `restore()`.

    Args:
        module: SkyRL's module that defines the functions.
        replacements: name -> replacement. Every name must exist in `module`.
        follow_imports: Also replace every other binding of the same object
            (any module, any name; and restore those made later). `False`:
            `module`'s own name only.

    Raises:
        UnsupportedSkyRL: `module` lacks one of the names (nothing is swapped).
        BaseException: whatever a module's assignment raises, after every
            binding this swap replaced was put back.
    """

    def __init__(self, module: ModuleType, replacements: Mapping[str, Any], *, follow_imports: bool = True) -> None:
        super().__init__()
        missing = [name for name in replacements if name not in vars(module)]
        if missing:
            raise UnsupportedSkyRL(
                f"{module.__name__} has no {', '.join(missing)}: torch_r3.integrations.skyrl replaces SkyRL "
                f"0.4.0's functions of that name, and the installed SkyRL is {skyrl_version()}; nothing was swapped"
            )
        self.module = module
        self.names = tuple(replacements)
        try:
            for name, value in replacements.items():
                (self.everywhere if follow_imports else self.owned)(module, name, value)
        except BaseException:
            self.undo()
            raise

    def restore(self) -> None:
        """Put the originals back wherever the replacements are bound now; a second call does nothing."""
        self.undo()


class Installed(contextlib.AbstractContextManager["Installed"]):
    """The swaps `install()` made: `uninstall()` (or leaving the `with` block) puts SkyRL's functions back.

    Attributes:
        worker: The worker side's `SkyRLWorkerReplay` (its `hooks` and
            `last_stats`), or `None` when the worker side was not swapped.
        worker_skipped: Why `install(worker=None)` left the worker side alone
            (SkyRL's Megatron model wrapper did not import here: a controller
            process), else `None`.
    """

    def __init__(
        self, swaps: Sequence[Swap], worker: SkyRLWorkerReplay | None, *, worker_skipped: str | None = None
    ) -> None:
        self._swaps: list[Swap] | None = list(swaps)
        self.worker = worker
        self.worker_skipped = worker_skipped

    @property
    def names(self) -> tuple[str, ...]:
        """Every replaced function, as `module.name`."""
        return tuple(name for s in self._swaps or () for name in s.swapped)

    @property
    def last_stats(self) -> Any:
        """The worker's last replaying schedule's `ReplayStats` (drift, live share, counts); `None` before one."""
        return None if self.worker is None else self.worker.last_stats

    def __repr__(self) -> str:
        state = "installed" if self._swaps is not None else "uninstalled"
        skipped = f"; worker side not swapped ({self.worker_skipped})" if self.worker_skipped else ""
        return f"Installed({', '.join(self.names)}; {state}{skipped})"

    def uninstall(self) -> None:
        """Restore SkyRL's own functions everywhere and close the worker's hooks; a second call does nothing."""
        if self._swaps is None:
            return
        swaps, self._swaps = self._swaps, None
        if self in _current:
            _current.remove(self)
        for swap in reversed(swaps):
            swap.restore()
        if self.worker is not None:
            self.worker.close()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(
    *,
    worker: bool | None = None,
    memory: Memory | None = None,
    uncaptured: str = "live",
    expert_load: bool = False,
    **deprecated: Any,
) -> Installed:
    """Swap `torch_r3` into SkyRL: one call per process, before training starts.

    Args:
        worker: Also replace the Megatron worker's replay set-up. `None`
            (default): where SkyRL's Megatron model wrapper imports (a worker
            process; the handle's `worker_skipped` says why not); `True`:
            required (its `ImportError` is raised); `False`: the controller side only.
        memory: A `torch_r3.Memory` for the controller's collation: its
            `buffers`, a `torch_r3.BufferPool` every step's packed routes come
            from (recycled once SkyRL drops the step's batch; by default fresh
            memory), and `workers`, copy threads (default: the CPUs this process
            may use). Not the worker side.
        uncaptured: The worker hooks' treatment of tokens without a captured
            route: `"live"` (default, the router's own top-k) or `"replay"`
            (SkyRL's filler routes, as SkyRL's own replay does).
        expert_load: The worker hooks count tokens per expert (`ReplayStats`).
        **deprecated: `buffers=` and `workers=`, each with a `DeprecationWarning`
            naming `memory=torch_r3.Memory(...)`.

    Returns:
        An `Installed` handle: `uninstall()` restores SkyRL's functions (it is
        also a context manager).

    Raises:
        RuntimeError: When torch_r3 is already installed (uninstall the first handle).
        UnsupportedSkyRL: A SkyRL module lacks a function this replaces (another
            SkyRL release): nothing is swapped.
        ImportError: SkyRL (or, with `worker=True`, its Megatron worker) cannot be imported.
    """
    _, memory = from_keywords("install", "packed", memory, deprecated, keywords=("buffers", "workers"))
    if _current:
        raise RuntimeError(f"torch_r3 is already installed in SkyRL ({_current[0]!r}); uninstall() it first")
    preprocess = importlib.import_module(controller.PREPROCESS)
    replay_utils = wrapper = None
    skipped = None
    if worker is not False:
        try:
            replay_utils = importlib.import_module(REPLAY_UTILS)
            wrapper = importlib.import_module(MODEL_WRAPPER)  # it binds the names: swapped there too
        except ImportError as err:
            if worker:
                raise
            skipped = f"{type(err).__name__}: {err}"
    worker = wrapper is not None

    def collate(rollout_expert_indices: Sequence[np.ndarray], total_real: np.ndarray) -> Any:
        return controller.collate_rollout_expert_indices(rollout_expert_indices, total_real, memory=memory)

    collate.__doc__ = controller.collate_rollout_expert_indices.__doc__
    swaps: list[Swap] = []
    side = SkyRLWorkerReplay(uncaptured=uncaptured, expert_load=expert_load) if worker else None
    try:
        swaps.append(
            Swap(preprocess, {controller.COLLATE: collate, controller.MASK: controller.make_router_padding_mask})
        )
        if side is not None:
            swaps.append(Swap(replay_utils, {name: getattr(side, name) for name in WORKER_NAMES}))  # type: ignore[arg-type]
            original = vars(wrapper)[SCHEDULE_LOOKUP] if SCHEDULE_LOOKUP in vars(wrapper) else None
            swaps.append(
                Swap(wrapper, {SCHEDULE_LOOKUP: side.get_forward_backward_func(original)}, follow_imports=False)  # type: ignore[arg-type]
            )
    except BaseException:
        for swap in reversed(swaps):
            swap.restore()
        raise
    handle = Installed(swaps, side, worker_skipped=skipped)
    _current.append(handle)
    return handle
