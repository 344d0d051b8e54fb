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

from torch_r3.health.check import (
    HEALTH_MODES,
    RouteHealthCheck,
    RouteHealthError,
    RouteHealthFinding,
    RouteHealthStats,
    RouteHealthWarning,
    ZeroRoutesWarning,
    check_route_health,
)

__all__ = [
    "HEALTH_MODES",
    "RouteHealthCheck",
    "RouteHealthError",
    "RouteHealthFinding",
    "RouteHealthStats",
    "RouteHealthWarning",
    "ZeroRoutesWarning",
    "check_route_health",
]
