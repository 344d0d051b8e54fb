"""The HTTP client to the inference server: `RemoteGenerateClient`.

One client for three servers, picked with `server=`: the torch_r3 server format
(`"torch_r3"`), SGLang's native `/generate` (`"sglang"`) and vLLM's native
`/inference/v1/generate` (`"vllm"`). Each format lives in its own module of
`torch_r3.rollout.protocols`; every one answers with the same `RemoteGenerateResult`,
whose routes are the canonical `[rows, layers, topk]` array of positions
`[start, P + O - 1)`. Transport concerns (sessions, retries, the body cap) live
in `torch_r3.rollout.transport`; the request path here only checks the arguments,
lets the protocol build the body, and reads the answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch_r3._extras import require

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+, and the package supports 3.10

require("aiohttp", "client")  # without aiohttp: name the extra that installs it
import numpy as np

from torch_r3._checks import check_bool, check_choice, check_int, check_positive, check_str
from torch_r3._deprecation import warn_external, warn_renamed
from torch_r3.errors import RemoteGenerateError
from torch_r3.health.check import RouteHealthCheck, ZeroRoutesWarning, health_check
from torch_r3.rollout._client_checks import (
    FLAT_TRANSPORT_KEYWORDS,
    check_base_url,
    check_moe_layers,
    check_prompt,
    check_salt,
    check_sampling_params,
    check_start,
    fold_transport_config,
)
from torch_r3.rollout._offload import off_loop
from torch_r3.rollout.protocols import CHATS, PROTOCOLS, SERVERS, GenerateCall, RouteLimits, WeightVersionSpan
from torch_r3.rollout.protocols.chat import check_messages
from torch_r3.rollout.protocols.native import MODEL_INFO_PATH
from torch_r3.rollout.protocols.spans import parse_body, route_text_bytes
from torch_r3.rollout.results import RemoteGenerateResult
from torch_r3.rollout.transport import HttpTransport, TransportConfig

__all__ = [
    "RemoteGenerateClient",
    "RemoteGenerateError",
    "RemoteGenerateResult",
    "TransportConfig",
    "WeightVersionSpan",
    "ZeroRoutesWarning",
]

# The engine behind each server= name, whose settings the health hints name.
_ENGINES = {"vllm": "vllm", "vllm-openai": "vllm", "skyrl": "vllm", "sglang": "sglang", "sglang-openai": "sglang"}


class RemoteGenerateClient:
    """An `aiohttp` client for the generate endpoint of an inference server.

    Use it as `async with RemoteGenerateClient(url) as client:`, or call `close`
    yourself. Without `session`, one `aiohttp.ClientSession` is created lazily
    per event loop and closed when that loop shuts down; the client pickles and
    works again wherever it is unpickled. With `session`, your session is used
    and never closed.

    Args:
        base_url: The server, e.g. `"http://127.0.0.1:30000"`, optionally with a
            path prefix; no query, fragment or credentials (send those as
            `headers`). Checked here, not at the first call.
        server: The server's API: `"torch_r3"`, `"sglang"`, `"vllm"` (native
            `/inference/v1/generate`) or `"vllm-openai"` (vLLM's OpenAI-compatible
            `/v1/completions`, and `/v1/chat/completions` through `chat`) or
            `"sglang-openai"` (SGLang's OpenAI-compatible `/v1/completions`, and
            `/v1/chat/completions` through `chat`; routes need `num_layers`
            and `topk`) or `"megatron"` (Megatron-core's inference server, `/v1/completions`) or
            `"skyrl"` (SkyRL's `/skyrl/v1/generate`).
        num_layers: Layers per route row the server sends: for SGLang and vLLM
            every hidden layer of the model (`num_hidden_layers`). Required for
            SGLang routes, native or OpenAI (its payload has no shape); checked when given.
        topk: Experts per token (`num_experts_per_tok`). Required for SGLang routes.
        num_experts: Routed experts per layer; when given, every id must be below it.
        indexer_layers: DSA indexer layers per row (SGLang's `num_indexer_layers`:
            `num_hidden_layers` for DeepSeek-V3.2-style models). Required for
            `return_indexer_topk`.
        index_topk: Positions each indexer query selects (`index_topk`).
            Required for `return_indexer_topk`.
        moe_layers: Indices into the routes' layer axis of the MoE layers; when
            given, a zero row in one of them is an engine-health finding (see
            `health`). Without them only rows zero in every layer are (dense
            layers are zero by design).
        health: What to do with routes that carry the signature of an engine
            capture bug (`torch_r3.health`: zero rows, a layer stuck on one
            row, stale repeated rows): `"raise"` (the default: `generate`
            raises `RouteHealthError`), `"warn"` (`RouteHealthWarning`,
            `ZeroRoutesWarning` for zero rows), `"count"`, or a
            `RouteHealthCheck` of your own (shared, e.g. by every client of a
            run). Its counters are `client.health.stats` either way.
        cache_salt: Default prefix-cache salt for every call (see `generate`).
        transport_config: The transport options as one `TransportConfig`
            (retries, backoff, timeouts, concurrency, the response body cap,
            headers, your own `session`, `ssl`, `trace_configs`), e.g. shared by
            several clients; the defaults without it.
        **deprecated: The transport options as flat keywords (`retries=`,
            `backoff=`, `max_backoff=`, `timeout=`, `connect_timeout=`,
            `max_concurrency=`, `max_response_bytes=`, `headers=`, `session=`,
            `ssl=`, `trace_configs=`), as before 0.3.0: each one warns
            (`DeprecationWarning`) and means the same option of `transport_config`.

    Raises:
        TypeError: An argument of the wrong kind, or a keyword the client never took.
        ValueError: A bad `base_url` (one ending in `/v1` included: give the
            server root), an unknown `server`, a `cache_salt` that breaks
            `generate`'s rules, or `transport_config` together with a flat
            transport keyword away from its default.

    Examples:
        >>> import asyncio
        >>> from torch_r3.testing import LoopbackServer
        >>> async def main(url):
        ...     async with RemoteGenerateClient(url, transport_config=TransportConfig(retries=2)) as client:
        ...         r = await client.generate([1, 2, 3], {"max_new_tokens": 2}, return_routed_experts=True)
        ...         return len(r.response_ids), r.routed_experts.shape
        >>> with LoopbackServer() as server:
        ...     asyncio.run(main(server.url))
        (2, (4, 2, 2))
    """

    def __init__(
        self,
        base_url: str,
        *,
        server: str = "torch_r3",
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        indexer_layers: int | None = None,
        index_topk: int | None = None,
        moe_layers: Sequence[int] | None = None,
        health: str | RouteHealthCheck = "raise",
        cache_salt: str | None = None,
        transport_config: TransportConfig | None = None,
        **deprecated: Any,
    ) -> None:
        unknown = [name for name in deprecated if name not in FLAT_TRANSPORT_KEYWORDS]
        if unknown:
            raise TypeError(f"RemoteGenerateClient() got an unexpected keyword argument {unknown[0]!r}")
        for name in deprecated:  # here, not in a helper: the warning names the caller's line
            warn_renamed(f"RemoteGenerateClient({name}=)", f"transport_config=TransportConfig({name}=...)")
        config = fold_transport_config(transport_config, deprecated)
        self.base_url = check_base_url(base_url)
        self.server = check_choice(server, "server", SERVERS)
        num_layers = None if num_layers is None else check_positive(num_layers, "num_layers")
        topk = None if topk is None else check_positive(topk, "topk")
        num_experts = None if num_experts is None else check_positive(num_experts, "num_experts")
        self.moe_layers = check_moe_layers(moe_layers, num_layers)
        self.health = health_check(health, engine=_ENGINES.get(self.server))
        self.cache_salt = check_salt(cache_salt)
        self.limits = RouteLimits(
            max_bytes=config.max_route_bytes,
            num_layers=num_layers,
            topk=topk,
            num_experts=num_experts,
            indexer_layers=None if indexer_layers is None else check_positive(indexer_layers, "indexer_layers"),
            index_topk=None if index_topk is None else check_positive(index_topk, "index_topk"),
            max_indexer_bytes=config.max_response_bytes,
        )
        self._transport = HttpTransport(self.base_url, config)

    @property
    def transport_config(self) -> TransportConfig:
        """The transport options in use: retries, timeouts, concurrency, the body cap, headers and session options."""
        return self._transport.config

    @property
    def transport(self) -> TransportConfig:
        """Deprecated alias of `transport_config` (it returns the config, not a transport)."""
        warn_external("RemoteGenerateClient.transport is deprecated: use transport_config")
        return self.transport_config

    @property
    def url(self) -> str:
        """The generate endpoint of the chosen server."""
        return self.base_url + PROTOCOLS[self.server].generate_path

    async def close(self) -> None:
        """Close this event loop's own session (other loops' sessions, and yours, stay open)."""
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"RemoteGenerateClient({self.base_url!r}, server={self.server!r}, {self.transport_config})"

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        session_id: str | None = None,
        model: str | None = None,
        cache_salt: str | None = None,
        return_indexer_topk: bool = False,
    ) -> RemoteGenerateResult:
        """Generate a continuation of `prompt_token_ids`.

        Args:
            prompt_token_ids: The prompt: a list, tuple, 1-D integer array or tensor.
            sampling_params: Passed to the server as they are, in its own names
                (SGLang: `max_new_tokens`; vLLM: `max_tokens`).
            return_routed_experts: Ask for the routes.
            routed_experts_prompt_start: Return routes only for positions from
                here on (in a multi-turn rollout, `RoutedExpertTrace.prompt_start`);
                an `int` in `[0, len(prompt)]`. Requires `return_routed_experts=True`.
                Sent as the server's own field (SGLang: `routed_experts_start_len`).
            session_id: Sent as the `X-Session-ID` header (sticky routing).
            model: Sent as the body's `model` field (not for SGLang).
            cache_salt: Keeps this request's prefix-cache entries apart from
                requests with another salt, e.g. `f"v{weight_version}"` so that
                no prefix computed by older weights is reused with its old
                routes. Overrides the client's default; a non-empty string of
                at most 128 characters without `@`, `/`, `\\` or NUL (vLLM
                0.30+ refuses others; the rule holds for every server).
                Sent as vLLM's and the torch_r3 server's `cache_salt`, as
                SGLang's `extra_key`.
            return_indexer_topk: Ask for the DSA indexer's selections
                (SGLang only; the client needs `indexer_layers=` and `index_topk=`).

        Returns:
            The decoded first choice; with routes, their row count is checked
            against `len(prompt) + len(response_ids) - 1 - routed_experts_prompt_start`.

        Raises:
            TypeError: An argument of the wrong kind (a `bool` prompt start included).
            ValueError: `routed_experts_prompt_start` out of range, or given
                without `return_routed_experts=True` or inside `sampling_params`;
                a prompt token id outside `[0, 2**63)`; `sampling_params["n"]`
                other than 1; a `cache_salt` breaking the rules above; SGLang
                routes without `num_layers`/`topk`.
            RouteHealthError: The routes carry an engine capture-bug signature
                (with `health="raise"`; see the class's `health`).
            RemoteGenerateError: Every failure of the call itself: a
                non-retryable answer (a `404` also says what to check), a
                redirect (never followed), retries exhausted, a body over the
                cap, a response that breaks the server's format. It names the URL.
        """
        protocol = PROTOCOLS[self.server]
        prompt = check_prompt(prompt_token_ids)
        params = check_sampling_params(sampling_params)
        # Not check_bool: a test pins this wording ("must be a bool"); the rule (NumPy bools accepted) is the same.
        if not isinstance(return_routed_experts, (bool, np.bool_)):
            raise TypeError(f"return_routed_experts must be a bool, got {type(return_routed_experts).__name__}")
        return_routed_experts = bool(return_routed_experts)
        start = check_start(routed_experts_prompt_start, len(prompt), return_routed_experts)
        self._check_route_shape(return_routed_experts)
        return_indexer_topk = check_bool(return_indexer_topk, "return_indexer_topk")
        if return_indexer_topk:
            if self.server != "sglang":
                raise ValueError(
                    f"return_indexer_topk: only SGLang returns indexer selections (server={self.server!r})"
                )
            if self.limits.indexer_layers is None or self.limits.index_topk is None:
                raise ValueError(
                    "return_indexer_topk: SGLang sends selections without their shape: give the client "
                    "indexer_layers= (num_indexer_layers) and index_topk="
                )
        if model is not None:
            check_str(model, "model")
        if session_id is not None:
            check_str(session_id, "session_id")
        salt = check_salt(cache_salt) if cache_salt is not None else self.cache_salt
        call = GenerateCall(prompt, params, return_routed_experts, start, salt, model, return_indexer_topk)
        not_found = (
            f"check base_url (the server root, e.g. http://host:port, with no /v1) and server={self.server!r}, "
            f"which sends {protocol.generate_path}{_NOT_FOUND_HINTS.get(self.server, '')}"
        )
        return await self._send(
            protocol.generate_path,
            protocol.request_body(call),
            protocol.route_text_paths,
            functools.partial(_read_generate, protocol, call, self.limits),
            start=start,
            session_id=session_id,
            answer=f"the {self.server} format",
            not_found=not_found,
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        session_id: str | None = None,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> RemoteGenerateResult:
        """One chat turn on `/v1/chat/completions` of vLLM (`server="vllm-openai"`) or SGLang (`"sglang-openai"`).

        The server renders `messages` with its chat template, so the rows
        describe the server's tokens: the result's `prompt_token_ids` are that
        rendering (the client asks for them with `return_token_ids`; vLLM
        answers them at the top level, SGLang in `choices[0]`). Key a
        multi-turn trace by them: `trace.record_result(r,
        prompt_len=len(r.prompt_token_ids), prompt_ids=r.prompt_token_ids)`,
        which also refuses a turn whose template re-rendered tokens the trace
        already holds routes for.

        Args:
            messages: The conversation so far: a list of `{"role", "content", ...}` objects.
            sampling_params: Top-level OpenAI fields (`max_tokens`, `temperature`, ...).
            return_routed_experts: Ask for the routes (the server must run with them on).
            routed_experts_prompt_start: As in `generate`; checked against the
                rendered prompt's length when the answer arrives.
            session_id: As in `generate`.
            model: The body's `model` field.
            cache_salt: As in `generate`.

        Returns:
            The first choice, with `prompt_token_ids` set.

        Raises:
            ValueError: The client is for a server without a chat protocol
                here (the native endpoints take token ids: use `generate`), or
                an argument breaks `generate`'s rules.
            TypeError: `messages` is not a list of objects with a string `role`.
            RouteHealthError: As `generate`.
            RemoteGenerateError: As `generate`, and for an answer without
                the rendered prompt's token ids (a server too old to return
                them: its rows cannot be keyed).
        """
        chat = CHATS.get(self.server)
        if chat is None:
            raise ValueError(
                f"chat() speaks the OpenAI-compatible /v1/chat/completions of server='vllm-openai' or "
                f"'sglang-openai', not server={self.server!r}: the rows must be keyed by the tokens the server "
                "rendered, which only those answers name (send token ids with generate() instead)"
            )
        self._check_route_shape(bool(return_routed_experts))
        body_messages = check_messages(messages)
        params = check_sampling_params(sampling_params)
        if not isinstance(return_routed_experts, (bool, np.bool_)):
            raise TypeError(f"return_routed_experts must be a bool, got {type(return_routed_experts).__name__}")
        want = bool(return_routed_experts)
        start = (
            0
            if routed_experts_prompt_start is None
            else check_int(routed_experts_prompt_start, "routed_experts_prompt_start")
        )
        if start < 0 or (start and not want):
            raise ValueError("routed_experts_prompt_start must be >= 0 and requires return_routed_experts=True")
        if model is not None:
            check_str(model, "model")
        salt = check_salt(cache_salt) if cache_salt is not None else self.cache_salt
        if session_id is not None:
            check_str(session_id, "session_id")
        body = chat.request_body(
            body_messages, params, return_routed_experts=want, start=start, cache_salt=salt, model=model
        )
        read = functools.partial(chat.parse_response, return_routed_experts=want, start=start, limits=self.limits)
        return await self._send(
            chat.path,
            body,
            chat.route_text_paths,
            read,
            start=start,
            session_id=session_id,
            answer=f"the {self.server} chat format",
        )

    async def _send(
        self,
        path: str,
        body: dict[str, Any],
        route_text_paths: tuple[tuple[str, ...], ...],
        read: Callable[[Any], tuple[Sequence[int], Any]],
        *,
        start: int,
        session_id: str | None,
        answer: str,
        not_found: str | None = None,
    ) -> RemoteGenerateResult:
        """POST `body` to `path` and return its health-checked result: the one send path of `generate` and `chat`.

        Args:
            path: The endpoint, appended to the base URL.
            body: The JSON body the protocol built.
            route_text_paths: Where the answer's base64 route text sits (read in place).
            read: Turns the parsed answer into (the prompt's token ids, the protocol's parsed response).
            start: The first position whose route was asked for.
            session_id: Sent as the `X-Session-ID` header (already checked).
            answer: The format the answer must keep, for the error when it does not.
            not_found: What to check when nothing answers the path (HTTP 404), or `None`.
        """
        url = self.base_url + path
        headers = {"X-Session-ID": session_id} if session_id is not None else {}
        try:
            # The route text stays in the body as views; the rest is parsed as JSON.
            parse = functools.partial(parse_body, paths=route_text_paths)
            raw = await self._transport.request("POST", path, body, headers, parse=parse)
        except RemoteGenerateError as exc:
            if exc.status != 404 or not_found is None:
                raise
            raise RemoteGenerateError(
                f"{exc} -- nothing answers POST {url}: {not_found}", url=url, status=404, attempts=exc.attempts
            ) from exc
        try:
            # Large payloads decode on the pool, with the GIL released: the loop keeps serving.
            size = route_text_bytes(raw, route_text_paths)
            prompt, parsed = await off_loop(size, read, raw)
        except (TypeError, ValueError, MemoryError, OverflowError) as exc:
            raise RemoteGenerateError(f"POST {url}: response breaks {answer}: {exc}", url=url, status=200) from exc
        return await self._result(
            parsed, list(prompt), start, raw, PROTOCOLS[self.server].without_routes, url, session_id
        )

    def _check_route_shape(self, want_routes: bool) -> None:
        if (
            want_routes
            and PROTOCOLS[self.server].needs_route_shape
            and None in (self.limits.num_layers, self.limits.topk)
        ):
            raise ValueError(
                f"server={self.server!r} sends routes without their shape: give the client num_layers= "
                "(the model's num_hidden_layers) and topk= (num_experts_per_tok)"
            )

    async def _result(
        self,
        parsed: Any,
        prompt: list[int],
        start: int,
        raw: Any,
        strip: Any,
        url: str,
        session_id: str | None,
    ) -> RemoteGenerateResult:
        """The result of a parsed answer, its routes health-checked against the tokens behind them."""
        routes = parsed.routed_experts
        if routes is not None:
            # Row i is position start + i: the prompt, then the generated tokens.
            tokens = (prompt + list(parsed.response_ids))[start : start + routes.shape[0]]
            who = f"POST {url} ({len(prompt)}-token prompt" + (f", session {session_id}" if session_id else "") + ")"
            check = functools.partial(self.health.check, routes, trajectory=who, token_ids=tokens)
            check = functools.partial(check, moe_layers=self.moe_layers or None, num_experts=self.limits.num_experts)
            # "warn": inline, the warning pointing at the caller's line; else large on the pool.
            await off_loop(0 if self.health.on_unhealthy == "warn" else routes.nbytes, check)
        return RemoteGenerateResult(
            **vars(parsed),
            num_experts=self.limits.num_experts,
            raw=strip(raw),
            health_checked=routes is not None,
            prompt_token_ids=tuple(prompt),
        )

    async def model_info(self) -> dict[str, Any]:
        """The served model's routing shape: `GET {base_url}/v1/model_info` (torch_r3 server only).

        Returns:
            The server's JSON object, with at least `num_layers` (MoE layers),
            `num_experts` and `topk`: what a trainer checks before it
            replays the server's routes in its own model.

        Raises:
            ValueError: The client is for SGLang or vLLM, which have no such endpoint.
            RemoteGenerateError: As `generate` (same retries), or when the
                answer lacks those integer fields.
        """
        if self.server != "torch_r3":
            raise ValueError(
                f"model_info() is the torch_r3 server's endpoint; for server={self.server!r} read the model's config"
            )
        raw = await self._transport.request("GET", MODEL_INFO_PATH)
        url = self.base_url + MODEL_INFO_PATH
        if not isinstance(raw, Mapping):
            raise RemoteGenerateError(
                f"GET {url}: expected a JSON object, got {type(raw).__name__}", url=url, status=200
            )
        for key in ("num_layers", "num_experts", "topk"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RemoteGenerateError(
                    f"GET {url}: {key!r} must be a positive int, got {value!r}", url=url, status=200
                )
        return dict(raw)


# What else to check when a server's generate path answers 404.
_NOT_FOUND_HINTS = {
    "vllm": "; since vLLM 0.30 /inference/v1/generate exists only when vLLM runs with --enable-scale-out",
    "sglang": " (SGLang's native API, not its OpenAI-compatible /v1)",
    "vllm-openai": " (vLLM's OpenAI-compatible server, `vllm serve`)",
    "sglang-openai": " (SGLang's OpenAI-compatible /v1 endpoints, `python -m sglang.launch_server`)",
    "megatron": " (Megatron-core's dynamic inference server)",
    "skyrl": " (SkyRL's vLLM server actor)",
}


def _read_generate(protocol: Any, call: GenerateCall, limits: RouteLimits, raw: Any) -> tuple[list[int], Any]:
    """The prompt that was sent and the protocol's reading of the answer to it."""
    return call.prompt, protocol.parse_response(raw, call, limits)
