"""Engine health: the capture-bug signatures a route array can carry, found before the routes are trusted.

Stage 2 of the data path (engine -> rollout -> **health** -> collate -> replay -> trainer). It imports only
the shared base, so the sender (`compact_routes`), the client, the trace and the in-process engines all
run the same check.

* `check`: `RouteHealthCheck`, `check_route_health` and the findings;
* `scan`: the passes over each row's expert ids read as packed machine words;
* `row_memory`: the bounded memory of recent route-row blocks (replayed rows across requests);
* `hints`: the findings' hint texts.
"""

from __future__ import annotations

from torch_r3.health import check

# Redundant aliases mark these as re-exports: `__all__` is `check.__all__`, the one list of the
# public names, which static tools cannot expand.
from torch_r3.health.check import (
    HEALTH_MODES as HEALTH_MODES,
    RouteHealthCheck as RouteHealthCheck,
    RouteHealthError as RouteHealthError,
    RouteHealthFinding as RouteHealthFinding,
    RouteHealthStats as RouteHealthStats,
    RouteHealthWarning as RouteHealthWarning,
    ZeroRoutesWarning as ZeroRoutesWarning,
    check_route_health as check_route_health,
)

__all__ = [*check.__all__]
