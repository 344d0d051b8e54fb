"""A Ray `worker_process_setup_hook` that installs torch_r3 into SkyRL, as the SkyRL guide tells a user to.

A user's hook is the last two lines of `install_torch_r3`: SkyRL installed with its
dependencies imports on its own. Here SkyRL's controller module comes from the wheel behind
bare parent packages first (`frameworks.load`), the one step only this suite needs.

The hook installs the controller side only (`worker=False`): the worker side imports SkyRL
0.4.0's Megatron model wrapper, whose `ppo_utils` registers its functions in a named Ray
actor at import time when Ray is initialized, and Ray 2.60 cannot create an actor while the
setup hook runs (the worker process aborts in `CoreWorker::CreateActor`).
"""

from __future__ import annotations

import os
from typing import Any

HANDLE: Any = None  # this process's `Installed`, set by the hook
HOOK_PID: int | None = None  # the process the hook ran in


def install_torch_r3() -> None:
    global HANDLE, HOOK_PID
    from tests.integrations.frameworks import load

    load("skyrl", "skyrl.train.dataset.preprocess")

    import torch_r3.integrations.skyrl as r3_skyrl

    HANDLE = r3_skyrl.install(worker=False)
    HOOK_PID = os.getpid()
