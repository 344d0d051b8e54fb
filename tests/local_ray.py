"""Starting a local Ray cluster on a loaded 2-core machine (the test modules that need one)."""

from __future__ import annotations

import os

# Ray gives the node agent 30 s to register by default: a loaded CI machine can miss that window.
AGENT_REGISTER_TIMEOUT_MS = "180000"


def start_local_ray(ray, **init_kwargs) -> None:
    """`ray.init(include_dashboard=False, log_to_driver=False, **init_kwargs)` with a long agent
    window (unless the environment sets one), retried once after a failed start."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", AGENT_REGISTER_TIMEOUT_MS)
    for attempt in (1, 2):
        try:
            ray.init(include_dashboard=False, log_to_driver=False, **init_kwargs)
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
