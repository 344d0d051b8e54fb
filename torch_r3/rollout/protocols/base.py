"""What every server protocol provides: the contract a protocol implements and the values it trades in.

A protocol is stateless: `ServerProtocol.request_body` turns a `GenerateCall`
into the JSON body its server expects, and `ServerProtocol.parse_response`
turns the server's parsed JSON into a `ParsedResponse` with routes in the
canonical layout `[rows, layers, topk]` for positions `[start, P + O - 1)`
(`P` prompt tokens, `O` generated tokens; the last sampled token never ran
forward, so it has no row). Malformed answers raise `WireFormatError`.
`ChoicesProtocol` is the shared shape of the torch_r3, vLLM and SkyRL formats.
The field readers and checks the protocols share live in
`torch_r3.rollout.protocols.fields` (their names are importable from here too).

This module needs NumPy only; it never imports aiohttp.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from torch_r3.rollout.codec import WireFormatError

# The readers the choices format uses; the `x as x` names keep the path they had
# before the readers moved to their own module (the very same objects).
from torch_r3.rollout.protocols.fields import (
    MAX_SALT_CHARS as MAX_SALT_CHARS,
    PROMPT_START_PARAM as PROMPT_START_PARAM,
    SALT_FORBIDDEN as SALT_FORBIDDEN,
    GenerateCall,
    WeightVersionSpan,
    chat_logprobs as chat_logprobs,
    check_cache_salt,
    completion_logprobs as completion_logprobs,
    expected_rows as expected_rows,
    finish_reason,
    first_choice,
    get_field,
    logprob as logprob,
    newest_version,
    params_with_start,
    slice_to_start,
    token_ids,
    weight_spans,
    weight_version as weight_version,
)

# The contract a protocol implements and the types the client hands it.
__all__ = [
    "ChoicesProtocol",
    "GenerateCall",
    "ParsedResponse",
    "RouteLimits",
    "ServerProtocol",
    "WeightVersionSpan",
    "check_cache_salt",
]


@dataclass(frozen=True)
class RouteLimits:
    """What the client knows about the routes it may receive.

    Attributes:
        max_bytes: The cap on one decoded route payload.
        num_layers: Layers per row the server sends (every hidden layer for
            SGLang and vLLM), or `None` when unknown.
        topk: Experts per token, or `None` when unknown.
        num_experts: Routed experts per layer (ids must be below it), or `None`.
        indexer_layers: DSA indexer layers per row (SGLang's `num_indexer_layers`), or `None`.
        index_topk: Positions each indexer query selects, or `None`.
        max_indexer_bytes: The cap on one dense indexer payload.
    """

    max_bytes: int
    num_layers: int | None = None
    topk: int | None = None
    num_experts: int | None = None
    indexer_layers: int | None = None
    index_topk: int | None = None
    max_indexer_bytes: int = 1 << 32


@dataclass(frozen=True)
class ParsedResponse:
    """A server's answer, protocol-neutral.

    Attributes:
        response_ids: The generated token ids.
        response_logprobs: Their logprobs, or `None` when the server sent none.
        finish_reason: `"stop"`, `"length"`, `"abort"`, another server string, or `None`.
        routed_experts: Canonical routes of positions `[start, P + O - 1)`, or
            `None` when not asked for or the request was aborted before any row.
        weight_version: The server's weight version, or `None` when it reports
            none; with several spans, the newest (the last span's).
        weight_versions: The spans of weight versions over the generated
            tokens, in order; `()` when the server reports none.
        route_versions: The spans of weight versions over the returned route
            rows (0 = position `start`) where the server says which weights
            computed them (Megatron's `kv_cache_epoch`); `()` otherwise.
        indexer_topk: The DSA indexer selections of positions `[0, P + O - 1)`
            (`torch_r3.indexer.IndexerSelections`), or `None` when not asked for.
    """

    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    finish_reason: str | None
    routed_experts: np.ndarray | None
    weight_version: str | None
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    route_versions: tuple[WeightVersionSpan, ...] = ()
    indexer_topk: Any = None


class ServerProtocol(abc.ABC):
    """One inference server's generate API.

    Attributes:
        name: The `server=` name of `RemoteGenerateClient`.
        generate_path: The generate endpoint, appended to the base URL.
        salt_field: The top-level body field that carries `cache_salt`.
        needs_route_shape: Whether the route payload lacks its shape, so that
            the client must know `num_layers` and `topk` to read it.
    """

    name: ClassVar[str]
    generate_path: ClassVar[str]
    salt_field: ClassVar[str]
    needs_route_shape: ClassVar[bool] = False
    #: Where the answer carries its route payload: paths of keys, `"*"` for every list item.
    route_payload_paths: ClassVar[tuple[tuple[str, ...], ...]] = ()
    #: Where the base64 route text sits, each under a payload path: the client reads it
    #: in place (`torch_r3.rollout.protocols.spans.parse_body`), so `parse_response` finds a
    #: read-only `memoryview` there instead of a `str`; the codec's decoders take either.
    route_text_paths: ClassVar[tuple[tuple[str, ...], ...]] = ()

    @abc.abstractmethod
    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        """The JSON body for `call`.

        Raises:
            ValueError: `call.sampling_params` holds a key the protocol sets itself.
        """

    @abc.abstractmethod
    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        """Read the server's parsed JSON answer to `call`.

        Raises:
            WireFormatError: The answer breaks the server's format, or its
                routes do not cover positions `[call.start, P + O - 1)`.
        """

    def salted(self, body: dict[str, Any], call: GenerateCall) -> dict[str, Any]:
        """`body` with the salt field added when `call` has a salt.

        Raises:
            TypeError: The salt is not a string.
            ValueError: The salt breaks `check_cache_salt`'s rules, so it is never sent.
        """
        if call.cache_salt is not None:
            body[self.salt_field] = check_cache_salt(call.cache_salt)
        return body

    def without_routes(self, raw: Any) -> Any:
        """`raw` without its route payload (copies along the way; `raw` itself is left as it is).

        What `RemoteGenerateResult.raw` keeps: the decoded routes are in
        `routed_experts`, and the base64 text can be many times their size.
        """
        for path in self.route_payload_paths:
            raw = _drop(raw, path)
        return raw


class ChoicesProtocol(ServerProtocol):
    """A format with a top-level `token_ids` request and a `choices[0]` answer.

    The torch_r3 and vLLM formats share it: the request carries `token_ids`,
    `sampling_params` (the route start inside, as `routed_experts_prompt_start`)
    and an optional `model`; the answer's `choices[0]` carries `token_ids`, a
    string `finish_reason`, `logprobs` and `routed_experts`, which is `null` when
    the request was aborted before any forward pass (no token generated; then
    reported as `"abort"`). Subclasses say how logprobs and routes are encoded.

    Attributes:
        start_may_be_ignored: Accept an answer with every row from position 0
            although the start was past 0 (a server that does not know the field).
        null_routes_hint: Appended to the error for `null` routes after tokens were generated.
    """

    start_may_be_ignored: ClassVar[bool] = False
    null_routes_hint: ClassVar[str] = ""
    route_payload_paths = (("choices", "*", "routed_experts"),)
    route_text_paths: ClassVar[tuple[tuple[str, ...], ...]] = (("choices", "*", "routed_experts"),)

    @abc.abstractmethod
    def flags(self, call: GenerateCall) -> dict[str, Any]:
        """The protocol's own top-level request fields."""

    @abc.abstractmethod
    def read_logprobs(self, choice: Mapping[str, Any], ids: tuple[int, ...]) -> tuple[float, ...] | None:
        """The logprobs of `choices[0]`, one per generated token, or `None`."""

    @abc.abstractmethod
    def decode(self, payload: Any, limits: RouteLimits) -> np.ndarray:
        """Decode a non-null `choices[0].routed_experts`."""

    def sampling_params(self, call: GenerateCall) -> dict[str, Any]:
        """The body's `sampling_params`."""
        return params_with_start(call)

    def request_body(self, call: GenerateCall) -> dict[str, Any]:
        body: dict[str, Any] = {
            "token_ids": call.prompt,
            "sampling_params": self.sampling_params(call),
            **self.flags(call),
        }
        if call.model is not None:
            body["model"] = call.model
        return self.salted(body, call)

    def parse_response(self, raw: Any, call: GenerateCall, limits: RouteLimits) -> ParsedResponse:
        choice = first_choice(raw)
        ids = token_ids(get_field(choice, "token_ids", "choices[0]", list), "choices[0].token_ids")
        reason = finish_reason(
            get_field(choice, "finish_reason", "choices[0]", str, required=False), "choices[0].finish_reason"
        )
        logprobs = self.read_logprobs(choice, ids)
        routes = None
        if call.return_routed_experts:
            payload = choice.get("routed_experts")
            if payload is None and not ids:
                reason = "abort"  # aborted before any forward pass: no row to replay
            elif payload is None:
                raise WireFormatError(
                    f"routes were requested but choices[0].routed_experts is null or missing{self.null_routes_hint}"
                )
            else:
                routes = slice_to_start(
                    self.decode(payload, limits),
                    call,
                    len(ids),
                    "choices[0].routed_experts",
                    start_may_be_ignored=self.start_may_be_ignored,
                )
        spans = weight_spans(choice.get("weight_versions"), "choices[0].weight_versions", len(ids))
        return ParsedResponse(
            ids, logprobs, reason, routes, newest_version(self.read_weight_version(raw), spans), spans
        )

    def read_weight_version(self, raw: Mapping[str, Any]) -> str | None:
        """The answer's weight version (`None`: the format has none besides its spans)."""
        return None


def _drop(node: Any, path: tuple[str, ...]) -> Any:
    if not path:
        return node
    key, rest = path[0], path[1:]
    if key == "*":
        return [_drop(item, rest) for item in node] if isinstance(node, list) else node
    if not isinstance(node, Mapping) or key not in node:
        return node
    copy = dict(node)
    if rest:
        copy[key] = _drop(node[key], rest)
    else:
        del copy[key]
    return copy
