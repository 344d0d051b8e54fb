"""In-process vLLM: `LLM.generate` / `AsyncLLM.generate` outputs as `RemoteGenerateResult`s.

verl, NeMo-RL and TRL's colocated mode run vLLM inside the trainer's processes
(or a Ray actor) and never go through HTTP: each request comes back as a
`vllm.RequestOutput` whose `outputs` are `CompletionOutput`s, one per sample
(`n`), each with `token_ids`, `logprobs` (one `{token_id: Logprob}` per
generated token), `finish_reason`, `weight_versions` (spans over the generated
tokens; vLLM 0.32+, absent before) and `routed_experts`: a NumPy array `[rows, layers, topk]`
over every hidden layer, set on the completion's final output only.
`SamplingParams(routed_experts_prompt_start=s)` (vLLM 0.22+) trims the rows to
positions `s .. P + O - 2`, as on the HTTP servers. A vLLM before 0.22 has no
such field and sends every row from position 0; those rows are sliced to the
start only when the output's class comes from a `vllm` whose `__version__` is
below 0.22, since the last output of a `DELTA` stream can have as many rows.
vLLM 0.21 alone split the rows: the prompt's on `RequestOutput.prompt_routed_experts`
(shared by the samples), the generated tokens' on each `CompletionOutput.routed_experts`,
over the MoE layers only; they are joined here, in position order.

`vllm_results` turns one finished `RequestOutput` into one `RemoteGenerateResult`
per sample, in index order, with the routes compacted, range-checked, counted
against the row rule and health-checked (`torch_r3.health`) exactly as the
client does for an HTTP answer; `RoutedExpertTrace.record_result` takes them
as turns. `AsyncLLM.generate` streams: `VLLMOutputCollector` (or
`collect_vllm_stream`) merges a request's streamed outputs, in `DELTA` or
`CUMULATIVE` mode and with `n > 1`, into the same results.

The objects are read by their attributes only: this module never imports vLLM
(nor aiohttp), and `import torch_r3` stays free of both.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torch_r3._checks import check_bool, check_non_negative, check_positive
from torch_r3.health.check import RouteHealthCheck, health_check
from torch_r3.rollout.protocols import fields
from torch_r3.rollout.protocols.switches import missing_routes_hint
from torch_r3.rollout.results import RemoteGenerateResult
from torch_r3.routes import as_host_array, compact_routes

__all__ = ["VLLMOutputCollector", "collect_vllm_stream", "vllm_results"]

_DELTA_HINT = (
    "a DELTA stream's last output holds only its last tokens: merge the stream with VLLMOutputCollector(delta=True)"
)


@dataclass
class _Sample:
    """One completion index's merged state."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    routed_experts: Any = None
    weight_versions: Any = None


def vllm_results(
    output: Any,
    *,
    routed_experts_prompt_start: int = 0,
    return_routed_experts: bool = True,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    health: str | RouteHealthCheck = "raise",
) -> tuple[RemoteGenerateResult, ...]:
    """One finished `vllm.RequestOutput` as a `RemoteGenerateResult` per sample, in index order.

    Args:
        output: A finished `RequestOutput` (from `LLM.generate`, or the last of
            `AsyncLLM.generate`'s stream in `CUMULATIVE` or `FINAL_ONLY` mode;
            for `DELTA` streams use `VLLMOutputCollector`).
        routed_experts_prompt_start: The `SamplingParams.routed_experts_prompt_start`
            the request was sent with (the output does not carry it); with a
            `RoutedExpertTrace`, its `prompt_start`.
        return_routed_experts: Read the routes (`False`: leave them out, as the
            client does when they were not asked for).
        num_layers: Layers per row (`num_hidden_layers`), checked when given.
        topk: Experts per token, checked when given.
        num_experts: Routed experts per layer; every id must be below it.
        moe_layers: The MoE layers' indices in the layer axis, for the health check.
        health: As `RemoteGenerateClient(health=)`: `"raise"`, `"warn"`,
            `"count"` or a shared `RouteHealthCheck`.

    Returns:
        The results; each one's `raw` is `output` itself.

    Raises:
        TypeError: `output` is not a `RequestOutput`-like object.
        ValueError: A sample is unfinished, its routes are missing (the message
            names vLLM's switches), have the wrong shape or row count, or hold
            an id out of range; a log-prob is missing or not a log-probability;
            two completions share an `index`; the output is a `DELTA` stream's
            piece (its routes or weight-version spans cover more tokens than it holds).
        RouteHealthError: The routes carry an engine capture-bug signature.
    """
    reader = _Reader(
        routed_experts_prompt_start, return_routed_experts, num_layers, topk, num_experts, moe_layers, health
    )
    prompt, request_id = reader.prompt_of(output)
    samples = {}
    for c in _completions(output, request_id):
        samples[c.index] = _Sample(
            list(c.token_ids),
            None if c.logprobs is None else list(c.logprobs),
            c.finish_reason,
            c.routed_experts,
            _weight_versions(c),
        )
    return reader.results(prompt, request_id, samples, output, _prompt_routes(output))


class VLLMOutputCollector:
    """Merges one request's streamed `RequestOutput`s (`AsyncLLM.generate`) into final results.

    `AsyncLLM` streams in the request's `SamplingParams.output_kind`: `DELTA`
    outputs carry only the new tokens (`delta=True`), `CUMULATIVE` ones all
    tokens so far, `FINAL_ONLY` one output; with `n > 1` each output holds the
    samples that advanced. A sample's routes come with its final output only.
    In `DELTA` mode vLLM merges the outputs the consumer has not taken yet, and
    (vLLM 0.30 at least) that merge drops `routed_experts`: a consumer that falls
    behind loses the routes of a sample whose final output was merged (`results`
    then raises, saying so). Stream in `CUMULATIVE` mode when routes matter.

    Args:
        delta: The stream is in `RequestOutputKind.DELTA` mode.

    Examples:
        See the inference-server guide's section on in-process vLLM.
    """

    def __init__(self, *, delta: bool) -> None:
        self.delta = check_bool(delta, "delta")
        self._samples: dict[int, _Sample] = {}
        self._prompt: list[int] | None = None
        self._request_id: Any = None
        self._last: Any = None
        self._prompt_routes: Any = None
        self.finished = False

    def add(self, output: Any) -> None:
        """Take the next `RequestOutput` of the stream.

        Raises:
            TypeError: `output` is not a `RequestOutput`-like object.
            ValueError: It belongs to another request, or comes after the stream finished.
        """
        prompt, request_id = _Reader.prompt_of(output)
        if self._prompt is None:
            self._prompt, self._request_id = prompt, request_id
        elif request_id != self._request_id or prompt != self._prompt:
            raise ValueError(
                f"request {request_id!r}: a stream's outputs must all belong to request {self._request_id!r} "
                "(use one VLLMOutputCollector per request)"
            )
        if self.finished:
            raise ValueError(f"request {request_id!r}: an output arrived after the stream finished")
        for c in _completions(output, request_id):
            sample = self._samples.setdefault(c.index, _Sample())
            if sample.finish_reason is not None:
                raise ValueError(f"request {request_id!r}, sample {c.index}: an output arrived after it finished")
            ids = list(c.token_ids)
            logprobs = None if c.logprobs is None else list(c.logprobs)
            if self.delta:
                sample.token_ids.extend(ids)
                if logprobs is not None:
                    sample.logprobs = (sample.logprobs or []) + logprobs
            else:
                sample.token_ids, sample.logprobs = ids, logprobs
            sample.finish_reason = c.finish_reason
            if c.routed_experts is not None:
                sample.routed_experts = c.routed_experts
            sample.weight_versions = _weight_versions(c)
        if _prompt_routes(output) is not None:
            self._prompt_routes = _prompt_routes(output)
        self._last = output
        self.finished = bool(getattr(output, "finished", False))

    def results(
        self,
        *,
        routed_experts_prompt_start: int = 0,
        return_routed_experts: bool = True,
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        moe_layers: Sequence[int] | None = None,
        health: str | RouteHealthCheck = "raise",
    ) -> tuple[RemoteGenerateResult, ...]:
        """The merged samples as results, as `vllm_results` (same arguments); `raw` is the last output.

        Raises:
            ValueError: Nothing was added, or the stream has not finished (its last output's
                `finished` is False, even where every sample seen has finished: with `n > 1` a
                sample that has produced nothing yet is in no output), naming the request and
                the samples seen; otherwise as `vllm_results`.
        """
        if self._prompt is None:
            raise ValueError("VLLMOutputCollector: no output was added")
        if not self.finished:
            # With n > 1, a sample that has produced nothing yet is in no output: only `finished` tells.
            running = [i for i in sorted(self._samples) if self._samples[i].finish_reason is None]
            raise ValueError(
                f"request {self._request_id!r} has not finished (its last RequestOutput has finished=False): "
                f"samples seen {sorted(self._samples)}, of which {running} are still running, and a sample "
                "that has produced nothing yet is in none of the outputs; add the stream's last output first"
            )
        reader = _Reader(
            routed_experts_prompt_start, return_routed_experts, num_layers, topk, num_experts, moe_layers, health
        )
        reader.delta = self.delta
        return reader.results(self._prompt, self._request_id, self._samples, self._last, self._prompt_routes)


async def collect_vllm_stream(
    stream: AsyncIterable[Any], *, delta: bool, **kwargs: Any
) -> tuple[RemoteGenerateResult, ...]:
    """Drain one request's `AsyncLLM.generate` stream and return `VLLMOutputCollector.results(**kwargs)`."""
    collector = VLLMOutputCollector(delta=delta)
    async for output in stream:
        collector.add(output)
    return collector.results(**kwargs)


class _Reader:
    """The argument checks and the per-sample conversion `vllm_results` and the collector share."""

    def __init__(
        self,
        start: Any,
        want_routes: Any,
        num_layers: Any,
        topk: Any,
        num_experts: Any,
        moe_layers: Any,
        health: Any,
    ) -> None:
        self.start = check_non_negative(start, "routed_experts_prompt_start")
        self.want_routes = check_bool(want_routes, "return_routed_experts")
        self.num_layers = None if num_layers is None else check_positive(num_layers, "num_layers")
        self.topk = None if topk is None else check_positive(topk, "topk")
        self.num_experts = None if num_experts is None else check_positive(num_experts, "num_experts")
        self.moe_layers = None if moe_layers is None else tuple(moe_layers)
        self.health = health_check(health, engine="vllm")
        self.delta = False  # the outputs came from a DELTA stream (set by the collector)

    @staticmethod
    def prompt_of(output: Any) -> tuple[list[int], Any]:
        try:
            prompt, request_id = output.prompt_token_ids, output.request_id
            output.outputs  # noqa: B018 - checked here so that a wrong object fails with one message
        except AttributeError:
            raise TypeError(
                f"expected a vllm RequestOutput (prompt_token_ids, request_id, outputs), got {type(output).__name__}"
            ) from None
        if prompt is None:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is None (a prompt given as embeddings?)")
        return list(fields.token_ids(list(prompt), f"request {request_id!r}: prompt_token_ids")), request_id

    def results(
        self, prompt: list[int], request_id: Any, samples: dict[int, _Sample], raw: Any, prompt_routes: Any = None
    ) -> tuple[RemoteGenerateResult, ...]:
        if not samples:
            raise ValueError(f"request {request_id!r}: the output holds no completion")
        if self.start > len(prompt):
            raise ValueError(
                f"request {request_id!r}: routed_experts_prompt_start {self.start} is past the {len(prompt)}-token prompt"
            )
        return tuple(
            self._one(prompt, f"request {request_id!r}, sample {i}", samples[i], raw, prompt_routes)
            for i in sorted(samples)
        )

    def _one(self, prompt: list[int], who: str, sample: _Sample, raw: Any, prompt_routes: Any) -> RemoteGenerateResult:
        ids = fields.token_ids(sample.token_ids, f"{who}: token_ids")
        if sample.finish_reason is None:
            raise ValueError(
                f"{who} has not finished (finish_reason is None): vLLM sends a sample's routes with its final "
                "output; pass the finished RequestOutput (collect a stream with VLLMOutputCollector)"
            )
        reason = fields.finish_reason(str(sample.finish_reason), f"{who}: finish_reason")
        logprobs = None if sample.logprobs is None else _logprobs(sample.logprobs, ids, who)
        routes = None
        if self.want_routes:
            array = sample.routed_experts
            if prompt_routes is not None:
                array = _joined(prompt_routes, array, who)
            routes = self._routes(array, prompt, ids, reason, who, raw)
        spans = _weight_spans(sample.weight_versions, who, len(ids))
        checked = routes is not None
        if routes is not None:
            tokens = (prompt + list(ids))[self.start : self.start + routes.shape[0]]
            self.health.check(
                routes,
                trajectory=who,
                token_ids=tokens,
                moe_layers=self.moe_layers,
                num_experts=self.num_experts,
            )
        return RemoteGenerateResult(
            ids,
            logprobs,
            reason,
            routes,
            fields.newest_version(None, spans),
            spans,
            self.num_experts,
            raw,
            health_checked=checked,
            prompt_token_ids=tuple(prompt),
        )

    def _routes(
        self, array: Any, prompt: list[int], ids: tuple[int, ...], reason: str | None, who: str, raw: Any
    ) -> Any:
        if array is None:
            if not ids and reason == "abort":
                return None  # aborted before any forward pass: nothing to replay
            raise ValueError(
                f"{who}: routed_experts is None although routes were asked for "
                + (_DELTA_MERGE_HINT if self.delta else f"({missing_routes_hint('vllm')})")
            )
        host = as_host_array(array, f"{who}: routed_experts")
        if host.ndim != 3:
            raise ValueError(f"{who}: routed_experts must be [rows, layers, topk], got shape {host.shape}")
        for axis, want, what in ((1, self.num_layers, "num_layers"), (2, self.topk, "topk")):
            if want is not None and host.shape[axis] != want:
                raise ValueError(f"{who}: routed_experts has shape {host.shape}, expected {what}={want} on axis {axis}")
        routes = compact_routes(host, name=f"{who}: routed_experts", num_experts=self.num_experts, health=None)
        want = fields.expected_rows(len(prompt), len(ids), self.start)
        if routes.shape[0] == want:
            return routes
        full = fields.expected_rows(len(prompt), len(ids), 0)
        if self.start and routes.shape[0] == full and _ignores_prompt_start(raw):
            # A vLLM without routed_experts_prompt_start (before 0.22) sends every row: keep the asked-for ones.
            # Only then: a DELTA stream's last output with start = generated - last tokens has as many rows.
            return routes[self.start :].copy()
        raise ValueError(
            f"{who}: routed_experts has {routes.shape[0]} rows; positions {self.start} .. {len(prompt) + len(ids) - 2} "
            f"({len(prompt)} prompt + {len(ids)} generated tokens, routed_experts_prompt_start={self.start}) need {want}"
            + (f"; {_DELTA_HINT}" if routes.shape[0] > want else "")
            + (
                f"; {full} rows are every position from 0, as a vLLM before 0.22 sends (it ignores the start), "
                f"but this output comes from {_engine_version(raw)}"
                if self.start and routes.shape[0] == full
                else ""
            )
        )


# vLLM (0.30 at least) merges a DELTA stream's outputs that the consumer has not taken yet
# (`RequestOutput.add(aggregate=True)`), and the merge keeps the tokens but not `routed_experts`.
_DELTA_MERGE_HINT = (
    "(in a DELTA stream: when the consumer falls behind, vLLM merges the outputs it has not taken yet "
    "and that merge drops routed_experts, so the routes of a sample whose final output was merged are lost; "
    "stream with output_kind=RequestOutputKind.CUMULATIVE or FINAL_ONLY, whose outputs replace each other; "
    f"otherwise: {missing_routes_hint('vllm')})"
)


def _completions(output: Any, request_id: Any) -> list[Any]:
    completions = output.outputs
    if not isinstance(completions, Sequence):
        raise TypeError(f"request {request_id!r}: outputs must be a list of CompletionOutput")
    seen: dict[int, int] = {}
    for at, c in enumerate(completions):
        for name in ("index", "token_ids", "logprobs", "finish_reason", "routed_experts"):
            if not hasattr(c, name):
                raise TypeError(
                    f"request {request_id!r}: expected vllm CompletionOutputs (index, token_ids, logprobs, "
                    f"finish_reason, routed_experts), got {type(c).__name__} without {name}"
                )
        index = c.index
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"request {request_id!r}: outputs[{at}].index must be an int, got {type(index).__name__}")
        if index < 0:
            raise ValueError(f"request {request_id!r}: outputs[{at}].index must be >= 0, got {index}")
        if index in seen:
            raise ValueError(
                f"request {request_id!r}: outputs[{seen[index]}] and outputs[{at}] both have index {index} "
                "(one completion per sample in an output)"
            )
        seen[index] = at
    return list(completions)


def _vllm_version(output: Any) -> str | None:
    """The `__version__` of the vLLM that defined `output`'s class (imported, since the object exists), or `None`."""
    package = sys.modules.get(type(output).__module__.partition(".")[0])
    if package is None or package.__name__ != "vllm":
        return None
    version = getattr(package, "__version__", None)
    return version if isinstance(version, str) else None


def _engine_version(output: Any) -> str:
    version = _vllm_version(output)
    return f"vLLM {version}" if version else f"a {type(output).__name__} that is not vLLM's (its version is unknown)"


def _ignores_prompt_start(output: Any) -> bool:
    """Whether `output` comes from a vLLM before 0.22, which has no `routed_experts_prompt_start`."""
    match = re.match(r"(\d+)\.(\d+)", _vllm_version(output) or "")
    return match is not None and (int(match[1]), int(match[2])) < (0, 22)


def _weight_spans(spans: Any, who: str, generated: int) -> tuple[fields.WeightVersionSpan, ...]:
    """The sample's `weight_versions`, checked; spans past its tokens name the DELTA stream they come from."""
    dicts = _span_dicts(spans, who)
    ends = [d["end"] for d in dicts or () if isinstance(d["end"], int)]
    if ends and max(ends) > generated:
        raise ValueError(
            f"{who}: weight_versions cover {max(ends)} generated tokens, the output holds {generated}; {_DELTA_HINT}"
        )
    return fields.weight_spans(dicts, f"{who}: weight_versions", generated)


def _prompt_routes(output: Any) -> Any:
    """vLLM 0.21's `RequestOutput.prompt_routed_experts` (the prompt's rows); `None` in every other release."""
    return getattr(output, "prompt_routed_experts", None)


def _joined(prompt_routes: Any, generated: Any, who: str) -> Any:
    """vLLM 0.21's split rows, the prompt's then the generated tokens' (`None` when none was captured), as one array."""
    head = as_host_array(prompt_routes, f"{who}: prompt_routed_experts")
    if head.ndim != 3:
        raise ValueError(f"{who}: prompt_routed_experts must be [rows, layers, topk], got shape {head.shape}")
    if generated is None:
        return head
    tail = as_host_array(generated, f"{who}: routed_experts")
    if tail.ndim != 3 or tail.shape[1:] != head.shape[1:]:
        raise ValueError(
            f"{who}: routed_experts has shape {tail.shape}, the prompt's rows (prompt_routed_experts) "
            f"{head.shape}: the layer and topk axes must match"
        )
    return np.concatenate([head, tail])  # NumPy's common dtype: ids are never narrowed here


def _weight_versions(completion: Any) -> Any:
    """The completion's weight-version spans; `None` before vLLM 0.32, whose `CompletionOutput` has no such field."""
    return getattr(completion, "weight_versions", None)


def _logprobs(positions: list[Any], ids: tuple[int, ...], who: str) -> tuple[float, ...]:
    if len(positions) != len(ids):
        raise ValueError(f"{who}: logprobs has {len(positions)} positions for {len(ids)} tokens")
    out = []
    for i, (position, token) in enumerate(zip(positions, ids)):
        entry = position.get(token) if hasattr(position, "get") else None
        if entry is None:
            raise ValueError(f"{who}: logprobs[{i}] has no entry for the sampled token {token}")
        out.append(fields.logprob(getattr(entry, "logprob", entry), f"{who}: logprobs[{i}][{token}]"))
    return tuple(out)


def _span_dicts(spans: Any, who: str) -> list[dict[str, Any]] | None:
    if spans is None:
        return None
    try:
        return [{"version": s.version, "start": s.start, "end": s.end} for s in spans]
    except (AttributeError, TypeError):
        raise TypeError(f"{who}: weight_versions must be spans with version, start and end") from None
