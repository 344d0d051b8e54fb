"""Engine-health checks on captured routes: the signatures of the engines' known capture bugs.

A route array can be well formed (right shape, every id in range) and still be
wrong: the engine returned rows it never captured. Replaying them trains every
token through experts the policy did not choose, silently. The checks here look
for the signatures that released engines have produced:

- **zero rows**: a MoE layer's rows are all zero. With `topk >= 2` one such row
  is already impossible (a token's experts are distinct), so a single row
  decides; vLLM's fused FlashInfer ("monolithic") MoE kernels route inside the
  kernel and left the capture buffer all zero, and so did vLLM-Ascend 0.26; SGLang
  with prefill/decode disaggregation once sent all-zero prompt rows, and a
  pipeline stage that captured nothing leaves its layers zero.
- **constant layer**: one layer's rows are all the same non-zero row, over many
  tokens whose hidden states demonstrably differ (other layers vary, or the
  tokens do): a capture slot written once and never again.
- **stale rows**: one full row (every layer) repeated verbatim over a run of
  consecutive positions that hold different tokens: the padded capture slots
  that kept a row from an earlier forward (SGLang, fixed in
  sgl-project/sglang#36404).
- **replayed rows**: a run of full rows equal, in order, to a run another
  recent response returned, behind different tokens: capture slots this
  request reused that still held the earlier request's rows (the same SGLang
  bug, across requests). A `RouteHealthCheck` remembers fingerprints of the
  last `remember_blocks` blocks of `min_run` rows it passed (hashes and the
  tokens behind them; `torch_r3.health._row_memory`). Identical tokens are never a
  replay: a prefix-cached prompt legitimately replays the rows its cached
  blocks were computed with, for the same tokens.

What is decidable: dense layers are all zero by design and are never flagged
unless the caller names its MoE layers (`moe_layers=`) or no layer captured
anything. A constant layer and a stale run need many rows and evidence that the
hidden states vary (`min_rows`, `min_run`, `min_token_changes`): a trajectory
that repeats one token over and over has identical hidden states, so identical
routes are healthy there; a 1-token trajectory has one row per layer, and only
the zero-row signature (with `topk >= 2`) is decidable from it. Stale and
replayed runs need the token ids behind the rows. A replayed run is one of at
least `min_run` rows, at least half of them distinct (a constant run is the
stale-row signature), behind tokens that differ at `min_token_changes`
positions or more; it is found once it spans an aligned block of the earlier
response (any run of `2 * min_run - 1` rows does). When a layer's row can be
only one or two sets of experts (`topk == num_experts`: every row is the same
set; top-1 of 2 experts: a row is one bit, and a router leaning to one expert
sends it every token), identical rows say nothing: given `num_experts`, the
row-identity checks (constant layer, stale and replayed rows, top-1's
all-zero layer) are skipped and the check is counted in
`RouteHealthStats.uninformative`; zero rows with `topk >= 2` still decide.

The passes read each row's ids as packed machine words (`torch_r3.health._scan`):
one compare per row and layer, row hashes that only pick candidates (every
answer is confirmed on the ids), no full-width temporaries. They cost about
a tenth of decoding the same routes (`benchmarks/health_bench.py`).

`RouteHealthCheck` runs the checks and keeps `RouteHealthStats`; by default a
finding raises `RouteHealthError`, naming the trajectory, the layer, what was
seen and the engine setting to look at. `on_unhealthy="warn"` (a
`RouteHealthWarning`) or `"count"` accept such routes knowingly; every finding
is counted either way. NumPy only.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from torch_r3._checks import check_at_least, check_choice, check_int, check_positive, check_str
from torch_r3._deprecation import warn_external
from torch_r3.health._hints import CONSTANT_HINT, REPLAY_HINT, STALE_HINT, ZERO_HINTS
from torch_r3.health._row_memory import RowMemory, window_hashes
from torch_r3.health._scan import RouteScan

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

#: What a check does with a finding: refuse (the default), warn, or only count it.
HEALTH_MODES = ("raise", "warn", "count")
#: Rows a layer must have before "all one row" is evidence of a broken capture.
DEFAULT_MIN_ROWS = 64
#: Consecutive identical full rows that make a stale run.
DEFAULT_MIN_RUN = 16
#: Token changes (position `i` holding another token than `i - 1`) that show the hidden states vary.
DEFAULT_MIN_TOKEN_CHANGES = 8
#: Blocks of `min_run` rows a check remembers from the responses it passed (0: no replayed-rows check).
DEFAULT_REMEMBER_BLOCKS = 8192


class RouteHealthError(ValueError):
    """Routes that carry the signature of an engine capture bug (see `torch_r3.health`).

    Attributes:
        findings: The `RouteHealthFinding`s, the first of which the message describes.
    """

    def __init__(self, message: str, findings: Sequence[RouteHealthFinding]) -> None:
        super().__init__(message)
        self.findings = tuple(findings)


class RouteHealthWarning(RuntimeWarning):
    """Routes that carry the signature of an engine capture bug, accepted with `on_unhealthy="warn"`."""


class ZeroRoutesWarning(RouteHealthWarning):
    """A MoE layer's routes came back all zero (accepted with `on_unhealthy="warn"`).

    Zero is a valid expert id, but a layer routing every token of a capture to
    expert 0 (with `topk > 1`, impossible: a token's experts are distinct) is
    the signature of a capture buffer that was never written.
    """


@dataclass(frozen=True)
class RouteHealthFinding:
    """One signature found in one trajectory's routes.

    Attributes:
        kind: `"zero_rows"`, `"constant_layer"`, `"stale_rows"` or `"replayed_rows"`.
        trajectory: The trajectory's name, as the caller gave it.
        layer: The index into the routes' layer axis, or `None` for a finding
            over every layer (zero rows in every layer, a stale full row).
        rows: The row indices `(first, last)` the finding covers (inclusive).
        seen: What was seen, in words.
        hint: The engine setting to look at.
    """

    kind: str
    trajectory: str
    layer: int | None
    rows: tuple[int, int]
    seen: str
    hint: str

    def message(self) -> str:
        """The finding as one sentence for an error or a warning."""
        where = "every layer" if self.layer is None else f"layer {self.layer}"
        return f"{self.trajectory}: {where}: {self.seen} ({self.kind}); likely cause: {self.hint}"


@dataclass
class RouteHealthStats:
    """What a `RouteHealthCheck` has seen (a finding counts whether it was refused or accepted).

    Attributes:
        trajectories: Route arrays checked (one per `check` call: a trajectory or one turn of it).
        rows: Rows checked.
        zero_rows: `zero_rows` findings.
        constant_layers: `constant_layer` findings.
        stale_rows: `stale_rows` findings.
        replayed_rows: `replayed_rows` findings (runs repeated from another response).
        uninformative: Checks that skipped the row-identity checks (constant
            layer, stale rows, replayed rows, top-1's all-zero layer) because
            a layer's row can only be one or two sets of experts (`topk ==
            num_experts`, or top-1 of 2 experts): identical rows say nothing there.
        refused: Checks that raised.
        accepted_unhealthy: Checks with findings that were let through (`"warn"` or `"count"`).
    """

    trajectories: int = 0
    rows: int = 0
    zero_rows: int = 0
    constant_layers: int = 0
    stale_rows: int = 0
    replayed_rows: int = 0
    uninformative: int = 0
    refused: int = 0
    accepted_unhealthy: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name (e.g. for a metrics logger)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_STAT_FIELD = {
    "zero_rows": "zero_rows",
    "constant_layer": "constant_layers",
    "stale_rows": "stale_rows",
    "replayed_rows": "replayed_rows",
}


class RouteHealthCheck:
    """Checks route arrays for the engines' capture-bug signatures and counts what it finds.

    One object may serve many trajectories (its `stats` add up); it holds no
    routes, only fingerprints of recent ones (`remember_blocks`) for the
    replayed-rows signature, so share one across the clients of a run to
    catch replays between them (a pickled copy keeps the stats and starts
    with an empty memory). Thread-safe: the passes over the routes run
    unlocked (NumPy releases the GIL in most of them), the memory and the
    counters under a lock, so the client checks large payloads on its decode
    pool.

    Args:
        on_unhealthy: `"raise"` (the default: a `RouteHealthError`), `"warn"`
            (a `RouteHealthWarning`, `ZeroRoutesWarning` for zero rows) or
            `"count"` (only `stats`).
        moe_layers: Indices into the routes' layer axis that are MoE layers;
            a zero row there is a finding. Without them only rows that are zero
            in every layer are (dense layers are zero by design).
        engine: `"vllm"`, `"sglang"` or `None`: which engine's settings the hints name.
        num_experts: Routed experts per layer, when known. With `topk ==
            num_experts` (every row is the same set) or top-1 of 2 experts,
            the row-identity checks are skipped and counted in
            `stats.uninformative`; only zero rows with `topk >= 2` are decided.
        min_rows: Rows a layer needs before "one row throughout" is a finding.
        min_run: Consecutive identical full rows that make a stale run.
        min_token_changes: Token changes (or, for a constant layer, a varying
            other layer) that show the hidden states behind the rows differ;
            for a replayed run, positions whose tokens differ from the earlier response's.
        remember_blocks: Blocks of `min_run` rows remembered from the routes
            this check passed (with token ids), oldest dropped first; `0`
            turns the replayed-rows check off (the opt-out; `health="count"`
            keeps it and only counts).

    Raises:
        TypeError: An argument of the wrong kind.
        ValueError: An unknown `on_unhealthy`, a negative layer, a count below 1.

    Examples:
        >>> import numpy as np
        >>> check = RouteHealthCheck()
        >>> rng = np.random.default_rng(0)
        >>> healthy = np.stack([rng.permutation(8)[:2] for _ in range(10)])[:, None, :]
        >>> check.check(healthy, trajectory="sample 0")
        ()
        >>> check.check(np.zeros((3, 1, 2), np.uint8), trajectory="sample 1")
        Traceback (most recent call last):
            ...
        torch_r3.health.check.RouteHealthError: sample 1: every layer: rows 0..2 of 3 are all zero (zero_rows); ...
        >>> check.stats.zero_rows, check.stats.refused
        (1, 1)
    """

    def __init__(
        self,
        on_unhealthy: str = "raise",
        *,
        moe_layers: Sequence[int] | None = None,
        engine: str | None = None,
        num_experts: int | None = None,
        min_rows: int = DEFAULT_MIN_ROWS,
        min_run: int = DEFAULT_MIN_RUN,
        min_token_changes: int = DEFAULT_MIN_TOKEN_CHANGES,
        remember_blocks: int = DEFAULT_REMEMBER_BLOCKS,
    ) -> None:
        self.on_unhealthy = check_choice(on_unhealthy, "on_unhealthy", HEALTH_MODES)
        self.moe_layers = _layer_tuple(moe_layers, "moe_layers")
        if engine is not None:
            engine = check_str(engine, "engine")
        self.engine = engine
        self.num_experts = _experts(num_experts)
        self.min_rows = check_positive(min_rows, "min_rows")
        self.min_run = check_at_least(min_run, "min_run", 2)
        self.min_token_changes = check_positive(min_token_changes, "min_token_changes")
        self.remember_blocks = check_at_least(remember_blocks, "remember_blocks", 0)
        self.memory = RowMemory(self.min_run, self.remember_blocks, self.min_token_changes)
        self.stats = RouteHealthStats()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RouteHealthCheck({self.on_unhealthy!r}, moe_layers={self.moe_layers or None}, engine={self.engine!r})"

    def check(
        self,
        routes: np.ndarray,
        *,
        trajectory: str,
        token_ids: Sequence[int] | np.ndarray | None = None,
        moe_layers: Sequence[int] | None = None,
        engine: str | None = None,
        num_experts: int | None = None,
        stacklevel: int | None = None,
    ) -> tuple[RouteHealthFinding, ...]:
        """Check one trajectory's (or one turn's) routes `[rows, layers, topk]`.

        Args:
            routes: An integer NumPy array `[rows, layers, topk]` (already range-checked).
            trajectory: What to call it in messages (a sample id, a request).
            token_ids: The token at each row's position (`rows` of them), when
                known: the stale-run check needs them, and they show whether
                the hidden states vary.
            moe_layers: Overrides the check's `moe_layers` for this call.
            engine: Overrides the check's `engine` for this call.
            num_experts: Overrides the check's `num_experts` for this call.
            stacklevel: For the warning, as `warnings.warn`'s; by default the
                first line outside torch_r3 (the user's call).

        Returns:
            The findings (empty for healthy routes) when they were accepted.

        Raises:
            RouteHealthError: A finding, with `on_unhealthy="raise"`.
            TypeError: `routes` is not a 3-D integer array, or `token_ids` not integers.
            ValueError: `token_ids` has another length than `routes` has rows,
                or a MoE layer is outside the layer axis.
        """
        check_str(trajectory, "trajectory")
        if not isinstance(routes, np.ndarray) or routes.dtype.kind not in "iu" or routes.ndim != 3:
            got = f"{routes.ndim}-D {routes.dtype}" if isinstance(routes, np.ndarray) else type(routes).__name__
            raise TypeError(f"{trajectory}: routes must be a 3-D integer array [rows, layers, topk], got {got}")
        layers = self.moe_layers if moe_layers is None else _layer_tuple(moe_layers, "moe_layers")
        for layer in layers:
            if layer >= routes.shape[1]:
                raise ValueError(
                    f"{trajectory}: moe_layers holds {layer}, but the routes have {routes.shape[1]} layers"
                )
        tokens = _tokens(token_ids, routes.shape[0], trajectory)
        experts = self.num_experts if num_experts is None else _experts(num_experts)
        few = experts is not None and math.comb(experts, routes.shape[2]) in (1, 2)
        scan = RouteScan(routes)
        findings = self._findings(scan, trajectory, tokens, layers, self.engine if engine is None else engine, few)
        replay = tokens is not None and self.remember_blocks and not few
        windows = window_hashes(scan.row_hashes(), self.min_run) if replay else None
        with self._lock:  # the memory and the counters; the passes above read nothing shared
            if replay and tokens is not None:
                findings += self._replays(windows, scan.routes, tokens, trajectory)
                if not findings:
                    self.memory.remember(windows, scan.zero_rows(), tokens, trajectory)
            self.stats.trajectories += 1
            self.stats.rows += routes.shape[0]
            self.stats.uninformative += int(few)
            for finding in findings:
                field = _STAT_FIELD[finding.kind]
                setattr(self.stats, field, getattr(self.stats, field) + 1)
            if findings:
                if self.on_unhealthy == "raise":
                    self.stats.refused += 1
                else:
                    self.stats.accepted_unhealthy += 1
        if not findings:
            return ()
        text = "; ".join(f.message() for f in findings[:3]) + (
            f"; and {len(findings) - 3} more" if len(findings) > 3 else ""
        )
        if self.on_unhealthy == "raise":
            raise RouteHealthError(
                f"{text}. These routes would replay choices the policy never made; "
                "to accept them knowingly, pass health='warn' or health='count'",
                findings,
            )
        if self.on_unhealthy == "warn":
            category = ZeroRoutesWarning if findings[0].kind == "zero_rows" else RouteHealthWarning
            warn_external(text, category, stacklevel=None if stacklevel is None else stacklevel + 1)
        return tuple(findings)

    def _findings(
        self,
        scan: RouteScan,
        trajectory: str,
        tokens: np.ndarray | None,
        moe_layers: tuple[int, ...],
        engine: str | None,
        few: bool,
    ) -> list[RouteHealthFinding]:
        rows, topk = scan.rows, scan.topk
        if rows == 0:
            return []
        out: list[RouteHealthFinding] = []
        same_as_first = scan.same_as_first()  # [layers]: every row equals the first
        first_zero = ~scan.layer_words[0].any(axis=1)  # [layers]: the first row is zero there
        layer_constant = same_as_first & ~first_zero  # constant non-zero layers
        varies = ~same_as_first  # layers whose rows change
        token_changes = int(np.count_nonzero(tokens[1:] != tokens[:-1])) if tokens is not None else 0
        zero_hint = ZERO_HINTS.get(engine, ZERO_HINTS[None])

        def zero_finding(layer: int | None, mask: np.ndarray | None) -> None:
            idx = np.flatnonzero(mask) if mask is not None else np.empty(0, np.intp)
            if len(idx) == 0:
                return
            if topk == 1 and (
                few or len(idx) < max(rows, self.min_rows) or not _varies_apart(varies, layer, token_changes, self)
            ):
                return  # one expert per token: expert 0 is a real choice; only a long, all-zero layer decides
            first, last = int(idx[0]), int(idx[-1])
            span = (
                f"rows {first}..{last} of {rows} are"
                if len(idx) == last - first + 1
                else f"{len(idx)} of {rows} rows are"
            )
            out.append(RouteHealthFinding("zero_rows", trajectory, layer, (first, last), f"{span} all zero", zero_hint))

        if moe_layers:
            possible = scan.zero_candidate_layers()
            for layer in moe_layers:
                zero_finding(layer, scan.layer_zero_rows(layer) if possible[layer] else None)
        else:
            zero_finding(None, scan.zero_rows())
        if few:
            return out  # every row is one of at most two sets: identical rows say nothing (see the module)
        if rows >= self.min_rows:
            for index in np.flatnonzero(layer_constant):
                layer = int(index)
                if token_changes >= self.min_token_changes or bool(np.delete(varies, layer).any()):
                    row = scan.routes[0, layer].tolist()
                    out.append(
                        RouteHealthFinding(
                            "constant_layer",
                            trajectory,
                            layer,
                            (0, rows - 1),
                            f"all {rows} rows are {row} although the hidden states vary",
                            CONSTANT_HINT,
                        )
                    )
        if tokens is not None and rows >= self.min_run:
            out.extend(self._stale_runs(scan, tokens, trajectory))
        return out

    def forget(self) -> None:
        """Drop the remembered fingerprints (the replayed-rows check starts afresh)."""
        self.memory.clear()

    def _replays(
        self, windows: np.ndarray | None, routes: np.ndarray, tokens: np.ndarray, trajectory: str
    ) -> list[RouteHealthFinding]:
        return [
            RouteHealthFinding(
                "replayed_rows",
                trajectory,
                None,
                (r.first, r.last),
                f"rows {r.first}..{r.last} repeat, in every layer and in order, rows that {r.source} returned, "
                f"behind tokens that differ at {r.token_changes} positions",
                REPLAY_HINT,
            )
            for r in self.memory.replays(windows, routes, tokens)
        ]

    def _stale_runs(self, scan: RouteScan, tokens: np.ndarray, trajectory: str) -> list[RouteHealthFinding]:
        repeat = scan.repeats()  # row i+1 equals row i
        if not repeat.any():
            return []
        changes = tokens[1:] != tokens[:-1]
        zero = scan.zero_rows()
        out = []
        # Runs of True in `repeat`: edges of the padded mask.
        edges = np.flatnonzero(np.diff(np.concatenate(([False], repeat, [False])).astype(np.int8)))
        for a, b in zip(edges[::2], edges[1::2]):
            length = int(b - a) + 1  # rows a .. b are identical
            moved = int(np.count_nonzero(changes[a:b]))
            if length >= self.min_run and moved >= self.min_token_changes and not zero[a]:
                out.append(
                    RouteHealthFinding(
                        "stale_rows",
                        trajectory,
                        None,
                        (int(a), int(b)),
                        f"rows {int(a)}..{int(b)} repeat one row verbatim over {moved} token changes",
                        STALE_HINT,
                    )
                )
        return out


def check_route_health(
    routes: np.ndarray,
    *,
    trajectory: str = "routes",
    token_ids: Sequence[int] | np.ndarray | None = None,
    moe_layers: Sequence[int] | None = None,
    engine: str | None = None,
    on_unhealthy: str = "raise",
    num_experts: int | None = None,
) -> tuple[RouteHealthFinding, ...]:
    """`RouteHealthCheck(on_unhealthy, moe_layers=, engine=, num_experts=).check(routes, ...)` in one call.

    Examples:
        >>> import numpy as np
        >>> routes = np.tile(np.array([[3, 5]], np.uint8), (64, 2, 1))  # [64, 2, 2]
        >>> routes[:, 1] = np.random.default_rng(1).integers(0, 4, (64, 1)) * 2 + [0, 1]  # layer 1 varies
        >>> check_route_health(routes, on_unhealthy="count")[0].seen
        'all 64 rows are [3, 5] although the hidden states vary'
    """
    check = RouteHealthCheck(on_unhealthy, moe_layers=moe_layers, engine=engine, num_experts=num_experts)
    return check.check(routes, trajectory=trajectory, token_ids=token_ids)


def health_check(value: Any, name: str = "health", *, engine: str | None = None) -> RouteHealthCheck:
    """A `RouteHealthCheck` from a `health=` argument: a mode string or a check itself (shared, with its stats)."""
    if isinstance(value, RouteHealthCheck):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {HEALTH_MODES} or a RouteHealthCheck, got {type(value).__name__}")
    return RouteHealthCheck(check_choice(value, name, HEALTH_MODES), engine=engine)


def _varies_apart(varies: np.ndarray, layer: int | None, token_changes: int, check: RouteHealthCheck) -> bool:
    """Evidence, besides `layer` itself, that the hidden states behind the rows differ."""
    if token_changes >= check.min_token_changes:
        return True
    others = varies if layer is None else np.delete(varies, layer)
    return bool(others.any())


def _layer_tuple(layers: Any, name: str) -> tuple[int, ...]:
    if layers is None:
        return ()
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"{name} must be a sequence of layer indices, got {type(layers).__name__}")
    out = []
    for i, layer in enumerate(layers):
        layer = check_int(layer, f"{name}[{i}]")
        if layer < 0:
            raise ValueError(f"{name}[{i}] = {layer} is negative")
        out.append(layer)
    return tuple(out)


def _tokens(token_ids: Any, rows: int, trajectory: str) -> np.ndarray | None:
    if token_ids is None:
        return None
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise TypeError(f"{trajectory}: token_ids must be a 1-D sequence of ints")
    if tokens.shape[0] != rows:
        raise ValueError(f"{trajectory}: token_ids has {tokens.shape[0]} entries for {rows} route rows")
    # One dtype for the memory's token store; a uint64 id keeps its bits (only equality is asked of them).
    return tokens.view(np.int64) if tokens.dtype == np.uint64 else tokens.astype(np.int64, copy=False)


def _experts(num_experts: Any) -> int | None:
    return None if num_experts is None else check_positive(num_experts, "num_experts")
