"""Multi-turn capture: routes arrive one turn at a time and leave as one array.

In a multi-turn rollout every turn sends the whole conversation so far as the
prompt. The inference server evaluates it, so each turn can return the routes of
the positions it evaluated for the first time; nothing is sent twice when the
client passes `RoutedExpertTrace.prompt_start` as the server's start field
(the same for our own server, SGLang and vLLM). The trace stitches those turns
together and checks that every row arrived, once, in order, from one policy
version, with every expert id in range.

Captured rows always form a prefix of the trajectory's tokens. The trace never
pads or invents rows: the tail the engine never evaluated (the last sampled
token, a synthetic EOS) is left to the collator, which pads it and marks it in
`router_padding_mask`.

The rows themselves accumulate in `torch_r3.rollout._row_store.TokenMetadataTrace`; the
indexer selections' turns are stitched by `torch_r3.rollout.selections_trace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torch_r3._checks import (
    check_bool,
    check_int,
    check_integer_dtype,
    check_non_negative,
    check_positive,
    check_str,
)
from torch_r3.health.check import RouteHealthCheck, health_check
from torch_r3.rollout._row_store import TokenMetadataTrace
from torch_r3.rollout.selections_trace import SelectionTurns
from torch_r3.routes import as_host_array, check_expert_ids, is_canonical
from torch_r3.selections import IndexerSelections

__all__ = ["RoutedExpertTrace"]


def _id_tuple(ids: Any, what: str) -> tuple[int, ...]:
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch.Tensor, without importing torch
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"{what}: expected a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
        return tuple(ids.tolist())
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{what}: expected a list of token ids, got {type(ids).__name__}")
    if set(map(type, ids)) <= {int}:  # plain ints (what the client hands over): one C-level pass, no call per id
        return tuple(ids)
    return tuple(check_int(t, f"{what}[{i}]") for i, t in enumerate(ids))


class RoutedExpertTrace:
    """One trajectory's routes over a multi-turn rollout.

    Per turn: send `prompt_start` as the server's start field
    (`routed_experts_start_len` for SGLang, `routed_experts_prompt_start` for
    vLLM and our own server), then `record` what came back. At the end,
    `finalize` with the trajectory's token count returns the captured rows.

    A turn with prompt length `P` (the whole conversation so far) that
    generated `G` tokens makes the engine evaluate positions `0 .. P+G-2`
    (the last sampled token is never run forward), so the server returns rows
    `prompt_start .. P+G-2`: exactly `P - prompt_start + G - 1` rows. Turns
    may arrive in different dtypes (a later turn passing expert 255); the
    result is widened by dtype, never wrapped.

    Routes from two policy versions must not be glued into one trajectory
    silently: replay would force the newer policy through the older one's
    choices. `record` takes each turn's `weight_version` (e.g.
    `RemoteGenerateResult.weight_version`) and refuses a turn whose version
    differs from an earlier turn's, unless the trace was built with
    `allow_mixed_versions=True`. A turn without a version (`None`) never
    conflicts. Servers that report `weight_versions` spans (SGLang 0.5.19+,
    vLLM 0.32+) show a weight update that landed mid-request: pass them as
    `record(weight_versions=)` and such a turn is refused too.

    The trace copies each turn's routes on `record`: a caller may refill one
    buffer per turn. It cannot know what the tokens behind its rows were
    unless told: a chat template that re-renders earlier turns (a changed
    system prompt, stripped reasoning) changes tokens whose routes it already
    holds, and the rows then describe another text. Pass each turn's
    `prompt_ids` (and `response_ids`) to have that checked; without them the
    trace checks only the lengths.

    Args:
        num_layers: Expected layers per row; taken from the first non-empty
            turn when `None`.
        topk: Expected experts per token; taken from the first non-empty turn
            when `None`.
        num_experts: Routed experts per layer, when known: every id must be
            below it. Negative ids are refused in any case.
        allow_mixed_versions: Accept turns from different weight versions
            (knowingly: the rows then come from more than one policy).
        health: What `record` does with a turn whose rows carry an engine
            capture-bug signature (`torch_r3.health`; with the turn's token
            ids when `prompt_ids`/`response_ids` were given): `"raise"` (the
            default, `RouteHealthError`, the trace left as it was), `"warn"`,
            `"count"`, or a `RouteHealthCheck` shared with other traces (its
            `stats` add up). `record_result` skips turns the client checked.
        moe_layers: Indices into the layer axis of the MoE layers, for the
            health check (a zero row there is a finding).
        name: What to call the trajectory in messages (e.g. its sample id).
        resent_selections: For DSA models' indexer selections
            (`record(indexer_topk=)`): SGLang has no start field for them and
            resends every row each turn, so each turn's rows overlap the
            earlier turns'. `"check"` (the default) refuses a turn whose
            resent rows select other positions than before (`ValueError`
            naming the layer and row); `"latest"` keeps the latest turn's rows
            and counts the rows that changed in `selections_changed`.

    Raises:
        TypeError: a count is not an `int`.
        ValueError: only one of `num_layers` and `topk` is given, or a count
            is not positive.

    Examples:
        >>> import numpy as np
        >>> trace = RoutedExpertTrace(num_layers=1, topk=2)
        >>> trace.record(prompt_len=3, generated_len=2, routes=np.array([[[0, 1]], [[2, 3]], [[1, 3]], [[0, 2]]]))
        >>> trace.prompt_start  # send as the start field next turn
        4
        >>> trace.record(prompt_len=7, generated_len=1, routes=np.array([[[1, 2]], [[3, 0]], [[2, 1]]], np.uint8))
        >>> trace.finalize(token_count=9).shape  # 9 tokens: 8 + a synthetic EOS
        (7, 1, 2)
    """

    def __init__(
        self,
        *,
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        allow_mixed_versions: bool = False,
        health: str | RouteHealthCheck = "raise",
        moe_layers: Sequence[int] | None = None,
        name: str = "trajectory",
        resent_selections: str = "check",
    ) -> None:
        if (num_layers is None) != (topk is None):
            raise ValueError("RoutedExpertTrace: give both num_layers and topk, or neither")
        row_shape = None
        if num_layers is not None:
            row_shape = (check_positive(num_layers, "num_layers"), check_positive(topk, "topk"))
        if num_experts is not None:
            num_experts = check_positive(num_experts, "num_experts")
        allow_mixed_versions = check_bool(allow_mixed_versions, "allow_mixed_versions")
        self._rows = TokenMetadataTrace(row_shape=row_shape, name="routes")
        self._num_experts = None if num_experts is None else int(num_experts)
        self._allow_mixed = allow_mixed_versions
        self._versions: list[str | int | None] = []
        self.health = health_check(health)
        self._moe_layers = None if moe_layers is None else tuple(moe_layers)
        self.name = check_str(name, "name")
        # Token ids of the positions from 0 on, as far as the caller told us.
        self._known_ids: tuple[int, ...] = ()
        # DSA indexer selections: SGLang resends every row each turn; the latest covers the others.
        self._selections = SelectionTurns(resent=resent_selections, name=self.name)

    @property
    def prompt_start(self) -> int:
        """Rows captured so far: the value to send as the server's start field."""
        return self._rows.rows

    @property
    def turns(self) -> int:
        """Turns recorded so far."""
        return len(self._versions)

    @property
    def indexer_topk(self) -> IndexerSelections | None:
        """The trajectory's DSA indexer selections so far, rows `0 .. prompt_start - 1` (`None` without them).

        The compact `torch_r3.indexer.IndexerSelections` of the latest turn
        (SGLang resends every row each turn, checked against the earlier
        turns' as `resent_selections` says); collate them with
        `torch_r3.indexer.collate_selections` beside the routes.
        """
        return self._selections.selections

    @property
    def selections_changed(self) -> int:
        """Resent indexer rows that differed from an earlier turn's (`resent_selections="latest"` keeps the latest)."""
        return self._selections.changed

    @property
    def weight_versions(self) -> tuple[str | int | None, ...]:
        """The weight version of each recorded turn, in order (`None` where none was given).

        Examples:
            >>> import numpy as np
            >>> trace = RoutedExpertTrace()
            >>> trace.record(prompt_len=2, generated_len=1, routes=np.ones((2, 1, 1), np.uint8), weight_version="v3")
            >>> trace.weight_versions
            ('v3',)
        """
        return tuple(self._versions)

    def record(
        self,
        *,
        prompt_len: int,
        generated_len: int,
        routes: Any,
        weight_version: str | int | None = None,
        weight_versions: Sequence[Any] | None = None,
        prompt_ids: Sequence[int] | None = None,
        response_ids: Sequence[int] | None = None,
        indexer_topk: IndexerSelections | None = None,
    ) -> None:
        """Append one turn's routes, checking that exactly the expected rows arrived.

        On any error the trace is left as it was.

        Args:
            prompt_len: Tokens in this turn's prompt (the whole conversation so far).
            generated_len: Tokens generated in this turn.
            routes: The rows the server returned for positions
                `prompt_start .. prompt_len + generated_len - 2`: an integer
                array, tensor or tensor-like `[prompt_len - prompt_start +
                generated_len - 1, layers, topk]`, e.g.
                `RemoteGenerateResult.routed_experts`.
            weight_version: The policy version that routed this turn, when the
                server reports one (`str` or `int`).
            weight_versions: The spans of versions over this turn's generated
                tokens (`RemoteGenerateResult.weight_versions`: objects with
                `version`, `start`, `end`). More than one version means a
                weight update landed mid-request: the turn's rows come from two
                policies and are refused (unless `allow_mixed_versions`; then
                the newest is the turn's version). With one version, that is
                the turn's version, and `weight_version`, if given, must match.
            prompt_ids: This turn's prompt token ids (`prompt_len` of them):
                when given, the positions whose routes the trace already holds
                must carry the tokens an earlier turn's `prompt_ids` /
                `response_ids` gave for them (a re-rendered history is refused).
            response_ids: This turn's generated token ids (`generated_len` of
                them), remembered with `prompt_ids` for the next turn's check.
            indexer_topk: A DSA model's indexer selections of this turn
                (`RemoteGenerateResult.indexer_topk`): every evaluated position
                from 0, `prompt_len + generated_len - 1` rows. Give them on
                every turn or on none; the rows resent from earlier turns are
                checked as `resent_selections` says; `indexer_topk` then holds
                the trajectory's.

        Raises:
            TypeError: a length is not an `int`, `weight_version` is not a
                `str`, `int` or `None`, or `routes` is not an integer array or
                tensor (`None` included: the turn must carry routes).
            ValueError: `prompt_len < prompt_start` (the prompt must extend the
                captured prefix), the row count is not the expected one, the row
                shape differs from earlier turns, an expert id is negative or
                `>= num_experts`, or `weight_version` differs from an earlier
                turn's (unless `allow_mixed_versions`), or `prompt_ids`
                changes a token whose route is already held, or the indexer
                selections have the wrong rows or shape, are given on some
                turns only, or (`resent_selections="check"`) resend a row
                with other positions.
            RouteHealthError: The turn's rows carry an engine capture-bug
                signature (with `health="raise"`; a `ValueError`).
        """
        self._record(
            prompt_len,
            generated_len,
            routes,
            weight_version,
            weight_versions,
            prompt_ids,
            response_ids,
            indexer_topk,
            scan_ids=True,
            check_health=True,
        )

    def record_result(self, result: Any, *, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> None:
        """Append the turn a `RemoteGenerateResult` answered, without scanning its ids again.

        Shorthand for `record` with the result's routes, generated token count,
        `weight_version` and `weight_versions`, its `indexer_topk` (and, with
        `prompt_ids`, its `response_ids`). The client's decoder already range-checked the ids
        (never negative, below the client's `num_experts` when it had one):
        the trace trusts that check, and scans only when it knows a tighter
        bound than the client did (its own `num_experts` below the client's,
        or the client had none). The routes are still copied.

        Args:
            result: The `RemoteGenerateResult` of this turn.
            prompt_len: Tokens in this turn's prompt.
            prompt_ids: This turn's prompt token ids, as in `record`.

        Raises:
            TypeError: `result` is not a `RemoteGenerateResult`-like object
                (`routed_experts`, `response_ids`, `weight_version`,
                `weight_versions`, `num_experts`).
            ValueError: As `record`.
        """
        try:
            routes, ids = result.routed_experts, result.response_ids
            version, spans, checked = result.weight_version, result.weight_versions, result.num_experts
            healthy = bool(getattr(result, "health_checked", False))
            row_spans = tuple(getattr(result, "route_versions", ()))
            selections = getattr(result, "indexer_topk", None)
        except AttributeError:
            raise TypeError(
                f"turn {self.turns}: expected a RemoteGenerateResult, got {type(result).__name__}"
            ) from None
        bound_known = self._num_experts is None or (checked is not None and checked <= self._num_experts)
        self._check_route_versions(row_spans, spans, version)
        self._record(
            prompt_len,
            len(ids),
            routes,
            version,
            spans,
            prompt_ids,
            ids if prompt_ids is not None else None,
            selections,
            scan_ids=not bound_known,
            check_health=not healthy,
        )

    def _record(
        self,
        prompt_len: Any,
        generated_len: Any,
        routes: Any,
        weight_version: Any,
        weight_versions: Any,
        prompt_ids: Any,
        response_ids: Any,
        selections: Any,
        *,
        scan_ids: bool,
        check_health: bool,
    ) -> None:
        turn = f"turn {self.turns}"
        prompt_len = check_non_negative(prompt_len, f"{turn}: prompt_len")
        generated_len = check_non_negative(generated_len, f"{turn}: generated_len")
        weight_version = self._span_version(weight_version, weight_versions, turn)
        self._check_version(weight_version, turn)
        start = self.prompt_start
        known = self._check_token_ids(prompt_ids, response_ids, prompt_len, generated_len, start, turn)
        if prompt_len < start:
            raise ValueError(
                f"{turn}: prompt_len {prompt_len} is shorter than the {start} rows already captured; "
                "each turn's prompt must extend the conversation"
            )
        expected = prompt_len - start + generated_len - 1
        if expected < 0:
            raise ValueError(f"{turn}: prompt_len {prompt_len} with generated_len 0 evaluates no new position")
        if routes is None:
            raise TypeError(f"{turn}: routes is None; request with return_routed_experts=True")
        label = f"{turn}: routes"
        array = as_host_array(routes, label)
        check_integer_dtype(array, label)
        if array.ndim != 3:
            raise ValueError(f"{label}: routes must be [rows, layers, topk], got shape {array.shape}")
        if array.shape[0] != expected:
            # Rows from position 0 on a later turn: the request sent no prompt start.
            resend = (
                f"; ask for the rows from the trace's start ({start}): client.generate(prompt_ids, sampling_params, "
                "return_routed_experts=True, routed_experts_prompt_start=trace.prompt_start) (a keyword argument of "
                "generate and chat, not a sampling parameter; an in-process vLLM takes "
                f"SamplingParams(routed_experts_prompt_start={start}) and vllm_results(output, "
                f"routed_experts_prompt_start={start}))"
            )
            raise ValueError(
                f"{turn}: expected prompt_len - prompt_start + generated_len - 1 = {prompt_len} - {start} + "
                f"{generated_len} - 1 = {expected} rows, got {array.shape[0]}"
                + (resend if start and array.shape[0] == expected + start else "")
            )
        # The trace is where routes from the caller enter: one range scan here
        # (only what the dtype leaves open) lets the collator trust the dtype.
        if scan_ids:
            check_expert_ids(array, self._num_experts, name=label)
        if check_health:
            end = prompt_len + generated_len - 1  # rows cover positions start .. end - 1
            ids = known[start:end] if known is not None and len(known) >= end else None
            self.health.check(
                array,
                trajectory=f"{self.name} {turn}",
                token_ids=ids,
                moe_layers=self._moe_layers,
                num_experts=self._num_experts,
            )
        if selections is not None or self._selections.turns:
            if selections is None or self._selections.turns != self.turns:
                raise ValueError(
                    f"{turn}: indexer selections came with {self._selections.turns} of the {self.turns} earlier "
                    f"turns and {'not ' if selections is None else ''}with this one: request "
                    "return_indexer_topk on every turn of a trajectory, or on none"
                )
            changed = self._selections.check(selections, rows=prompt_len + generated_len - 1, turn=turn)
        if is_canonical(array.dtype):
            # Own the rows: the caller may refill its buffer for the next turn
            # (a non-canonical array is compacted into a fresh one by append).
            array = np.array(array, order="C", copy=True)
        self._rows.append(array, label=label)  # the row count is checked above
        if selections is not None:
            self._selections.keep(selections, changed)
        self._versions.append(weight_version)
        if known is not None:
            self._known_ids = known

    def _check_token_ids(
        self, prompt_ids: Any, response_ids: Any, prompt_len: int, generated_len: int, start: int, turn: str
    ) -> tuple[int, ...] | None:
        """The token ids known after this turn, with the held positions checked; `None` when not given."""
        if prompt_ids is None:
            if response_ids is not None:
                raise ValueError(f"{turn}: response_ids needs prompt_ids (the positions before it)")
            return None
        prompt = _id_tuple(prompt_ids, f"{turn}: prompt_ids")
        if len(prompt) != prompt_len:
            raise ValueError(f"{turn}: prompt_ids has {len(prompt)} tokens, but prompt_len is {prompt_len}")
        response: tuple[int, ...] = ()
        if response_ids is not None:
            response = _id_tuple(response_ids, f"{turn}: response_ids")
            if len(response) != generated_len:
                raise ValueError(
                    f"{turn}: response_ids has {len(response)} tokens, but generated_len is {generated_len}"
                )
        held = min(len(self._known_ids), start)
        for i in range(held):
            if prompt[i] != self._known_ids[i]:
                raise ValueError(
                    f"{turn}: prompt_ids[{i}] = {prompt[i]}, but the route held for position {i} was recorded "
                    f"for token {self._known_ids[i]}: the conversation was re-rendered (a chat template "
                    "rewrote earlier turns?); its routes no longer describe these tokens, start a new trace"
                )
        return prompt + response

    def _span_version(self, version: Any, spans: Any, turn: str) -> Any:
        """The turn's version given its spans: the one version, or the newest when mixing is allowed."""
        if spans is None:
            return version
        if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
            raise TypeError(f"{turn}: weight_versions must be a sequence of spans, got {type(spans).__name__}")
        if not spans:
            return version
        try:
            runs = [(span.version, span.start, span.end) for span in spans]
        except AttributeError:
            raise TypeError(f"{turn}: weight_versions must hold spans with version, start and end") from None
        distinct = list(dict.fromkeys(v for v, _, _ in runs))
        if len(distinct) > 1 and not self._allow_mixed:
            described = ", ".join(f"{v!r} (tokens {a}..{b - 1})" for v, a, b in runs)
            raise ValueError(
                f"{turn}: its tokens were generated by more than one weight version: {described}; "
                "a weight update landed mid-request, so its routes come from two policies. Drop the turn "
                "(or the trajectory), or pass RoutedExpertTrace(allow_mixed_versions=True) to accept it"
            )
        newest = runs[-1][0]
        if version is not None and len(distinct) == 1 and version != newest:
            raise ValueError(f"{turn}: weight_version {version!r} is not the version of its spans, {newest!r}")
        return newest

    def _check_route_versions(self, row_spans: tuple[Any, ...], spans: Any, version: Any) -> None:
        """Refuse a turn whose rows were computed by another weight version than its tokens (unless mixing is allowed)."""
        if not row_spans or self._allow_mixed:
            return
        token_versions = {s.version for s in spans or ()} | ({version} if version is not None else set())
        if len(token_versions) > 1:
            return  # the tokens' own spans are refused by `_span_version`, with their message
        rows = {s.version for s in row_spans}
        if len(rows | token_versions) > 1:
            described = ", ".join(f"{s.version!r} (rows {s.start}..{s.end - 1})" for s in row_spans)
            raise ValueError(
                f"turn {self.turns}: its route rows were computed by weight versions {described} but its tokens by "
                f"{sorted(map(str, token_versions))}: a prefix cached before a weight update kept its older routes. "
                "Flush the server's prefix cache after each weight update, drop the turn, or pass "
                "RoutedExpertTrace(allow_mixed_versions=True) to accept it"
            )

    def _check_version(self, version: Any, turn: str) -> None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise TypeError(f"{turn}: weight_version must be a str, an int or None, got {type(version).__name__}")
        if version is None or self._allow_mixed:
            return
        for i, earlier in enumerate(self._versions):
            if earlier is not None and earlier != version:
                raise ValueError(
                    f"{turn} was routed by weight version {version!r}, but turn {i} by {earlier!r}: "
                    "a trajectory's routes must come from one policy; start a new trace after a "
                    "weight update, or pass RoutedExpertTrace(allow_mixed_versions=True) to accept it"
                )

    def finalize(self, token_count: int) -> np.ndarray:
        """The captured rows `[rows, layers, topk]`, never padded.

        The versions these rows were routed by are in `weight_versions` (one
        entry per turn); the trace is left as it is.

        Args:
            token_count: Tokens in the finished trajectory, including any that
                were never evaluated (the last sampled token, a synthetic EOS).

        Returns:
            A new C-contiguous array of the widest canonical dtype seen.

        Raises:
            TypeError: `token_count` is not an `int`.
            ValueError: more rows were captured than the trajectory has tokens,
                or no rows were recorded and the row shape is unknown.
        """
        token_count = check_non_negative(token_count, "token_count")
        if self.prompt_start > token_count:
            raise ValueError(
                f"routes: {self.prompt_start} rows captured but the trajectory has only {token_count} tokens"
            )
        return self._rows.finalize()
