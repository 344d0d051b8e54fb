"""The HTTP client to the inference server: `RemoteGenerateClient`.

One client for three servers, picked with `server=`: the torch_r3 server format
(`"torch_r3"`), SGLang's native `/generate` (`"sglang"`) and vLLM's native
`/inference/v1/generate` (`"vllm"`). Each format lives in its own module of
`torch_r3.protocols`; every one answers with the same `RemoteGenerateResult`,
whose routes are the canonical `[rows, layers, topk]` array of positions
`[start, P + O - 1)`. Transport concerns (sessions, retries, the body cap) live
in `torch_r3.transport`; the request path here only checks the arguments,
lets the protocol build the body, and reads the answer.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_r3._extras import require

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+, and the package supports 3.10

require("aiohttp", "client")  # without aiohttp: name the extra that installs it
import aiohttp
import numpy as np
import yarl

from torch_r3._checks import check_choice, check_indices, check_int, check_positive, check_str
from torch_r3._offload import off_loop
from torch_r3.errors import RemoteGenerateError
from torch_r3.protocols import PROTOCOLS, SERVERS, GenerateCall, RouteLimits, WeightVersionSpan
from torch_r3.protocols.base import check_cache_salt
from torch_r3.protocols.native import MODEL_INFO_PATH
from torch_r3.protocols.spans import parse_body, route_text_bytes
from torch_r3.transport import DEFAULT_MAX_RESPONSE_BYTES, HttpTransport, TransportConfig

__all__ = [
    "RemoteGenerateClient",
    "RemoteGenerateError",
    "RemoteGenerateResult",
    "TransportConfig",
    "WeightVersionSpan",
    "ZeroRoutesWarning",
]

# Token ids travel as int64 (torch.long).
_TOKEN_ID_END = 1 << 63


class ZeroRoutesWarning(RuntimeWarning):
    """A MoE layer's routes came back all zero: the server likely failed to capture them.

    Zero is a valid expert id, but a layer routing every token of a capture to
    expert 0 (with `topk > 1`, impossible: a token's experts are distinct) is
    the signature of a capture buffer that was never written, as happened with
    some server versions and configurations (prefill/decode disaggregation,
    pipeline parallelism). Dense layers are all zero by design and never warn.
    """


@dataclass(frozen=True, eq=False)
class RemoteGenerateResult:
    """One generate call's answer (the first choice), the same for every server.

    Attributes:
        response_ids: The generated token ids.
        response_logprobs: Their logprobs, or `None` when the server sent none.
        finish_reason: `"stop"`, `"length"` or `"abort"` (SGLang's object and
            vLLM's string normalised), another string a server sent, or `None`.
        routed_experts: The routes `[rows, layers, topk]` of positions
            `routed_experts_prompt_start .. len(prompt) + len(response_ids) - 2`,
            a canonical NumPy array; `None` when not requested, or when the
            request was aborted before any forward pass (`finish_reason` is
            then `"abort"`).
        weight_version: The server's weight version (SGLang's
            `meta_info.weight_version`, the torch_r3 server's `weight_version`,
            the last of vLLM's `weight_versions` spans), or `None` when the
            server reports none (vLLM before 0.32). When a weight update
            landed mid-request it is the newest version; `weight_versions`
            says which tokens each version generated.
        weight_versions: `WeightVersionSpan`s `(version, start, end)` over the
            generated tokens, as SGLang 0.5.19+ and vLLM 0.32+ report them;
            `()` when the server reports none. Pass them to
            `RoutedExpertTrace.record(weight_versions=)`, which refuses a turn
            routed by more than one version.
        num_experts: The client's `num_experts`: every id in `routed_experts`
            was checked to be below it on receipt (`None`: only checked to be
            non-negative). `RoutedExpertTrace.record_result` relies on it to
            skip a second scan.
        raw: The parsed JSON response without its route payload (the base64
            text, often far larger than the decoded `routed_experts`, is not
            kept); every other field as the server sent it.
    """

    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    finish_reason: str | None
    routed_experts: np.ndarray | None
    weight_version: str | None
    weight_versions: tuple[WeightVersionSpan, ...]
    num_experts: int | None
    raw: Any


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
        server: The server's API: `"torch_r3"`, `"sglang"` or `"vllm"`.
        num_layers: Layers per route row the server sends: for SGLang and vLLM
            every hidden layer of the model (`num_hidden_layers`). Required for
            SGLang routes (its payload has no shape); checked when given.
        topk: Experts per token (`num_experts_per_tok`). Required for SGLang routes.
        num_experts: Routed experts per layer; when given, every id must be below it.
        moe_layers: Indices into the routes' layer axis of the MoE layers; when
            given, a MoE layer whose routes are all zero raises a
            `ZeroRoutesWarning`.
        cache_salt: Default prefix-cache salt for every call (see `generate`).
        max_response_bytes: The most bytes one response body may have (1 GiB by
            default); route payloads are capped at three quarters of it.
        retries: See `TransportConfig`.
        backoff: See `TransportConfig`.
        max_backoff: See `TransportConfig`.
        timeout: See `TransportConfig`.
        connect_timeout: See `TransportConfig`.
        max_concurrency: See `TransportConfig`.
        transport_config: All of the above as one `TransportConfig` (e.g.
            shared by several clients); then leave the flat keywords at
            their defaults.
        headers: Extra headers sent with every request (e.g. authorization).
        session: Your own `aiohttp.ClientSession`, used on the event loop it
            belongs to and never closed by the client.
        ssl: Passed to the `aiohttp.TCPConnector` of the client's own sessions
            (an `ssl.SSLContext`, or `False` to skip verification).
        trace_configs: `aiohttp.TraceConfig`s for the client's own sessions.

    Raises:
        TypeError: An argument of the wrong kind.
        ValueError: A bad `base_url` (one ending in `/v1` included: give the
            server root), an unknown `server`, a `cache_salt` that breaks
            `generate`'s rules, or `session` together with `ssl`/`trace_configs`.

    Examples:
        >>> import asyncio
        >>> from torch_r3.testing import LoopbackServer
        >>> async def main(url):
        ...     async with RemoteGenerateClient(url, retries=2) as client:
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
        moe_layers: Sequence[int] | None = None,
        cache_salt: str | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        timeout: float | None = 600.0,
        connect_timeout: float | None = 30.0,
        max_concurrency: int = 64,
        transport_config: TransportConfig | None = None,
        headers: Mapping[str, str] | None = None,
        session: aiohttp.ClientSession | None = None,
        ssl: Any = True,
        trace_configs: Sequence[aiohttp.TraceConfig] | None = None,
    ) -> None:
        self.base_url = _check_base_url(base_url)
        self.server = check_choice(server, "server", SERVERS)
        num_layers = None if num_layers is None else check_positive(num_layers, "num_layers")
        topk = None if topk is None else check_positive(topk, "topk")
        num_experts = None if num_experts is None else check_positive(num_experts, "num_experts")
        self.moe_layers = _check_moe_layers(moe_layers, num_layers)
        self.cache_salt = _check_salt(cache_salt)
        flat = {
            "retries": retries,
            "backoff": backoff,
            "max_backoff": max_backoff,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "max_concurrency": max_concurrency,
            "max_response_bytes": max_response_bytes,
        }
        config = _transport_config(transport_config, flat)
        self.limits = RouteLimits(
            max_bytes=config.max_route_bytes,
            num_layers=num_layers,
            topk=topk,
            num_experts=num_experts,
        )
        self._transport = HttpTransport(
            self.base_url, config, headers=headers, session=session, ssl=ssl, trace_configs=trace_configs
        )

    @property
    def transport_config(self) -> TransportConfig:
        """The retries, timeouts, concurrency and body cap in use."""
        return self._transport.config

    @property
    def transport(self) -> TransportConfig:
        """Deprecated alias of `transport_config` (it returns the config, not a transport)."""
        warnings.warn(
            "RemoteGenerateClient.transport is deprecated: use transport_config", DeprecationWarning, stacklevel=2
        )
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
            RemoteGenerateError: Every failure of the call itself: a
                non-retryable answer (a `404` also says what to check), a
                redirect (never followed), retries exhausted, a body over the
                cap, a response that breaks the server's format. It names the URL.
        """
        protocol = PROTOCOLS[self.server]
        prompt = _token_list(prompt_token_ids)
        params = _sampling_params(sampling_params)
        # Not check_bool: a test pins this wording ("must be a bool"); the rule (NumPy bools accepted) is the same.
        if not isinstance(return_routed_experts, (bool, np.bool_)):
            raise TypeError(f"return_routed_experts must be a bool, got {type(return_routed_experts).__name__}")
        return_routed_experts = bool(return_routed_experts)
        start = _check_start(routed_experts_prompt_start, len(prompt), return_routed_experts)
        if (
            return_routed_experts
            and protocol.needs_route_shape
            and (self.limits.num_layers is None or self.limits.topk is None)
        ):
            raise ValueError(
                f"server={self.server!r} sends routes without their shape: give the client num_layers= "
                "(the model's num_hidden_layers) and topk= (num_experts_per_tok)"
            )
        if model is not None:
            check_str(model, "model")
        headers = {}
        if session_id is not None:
            headers["X-Session-ID"] = check_str(session_id, "session_id")
        salt = _check_salt(cache_salt) if cache_salt is not None else self.cache_salt
        call = GenerateCall(prompt, params, return_routed_experts, start, salt, model)
        body = protocol.request_body(call)
        url = self.url
        try:
            # The route text stays in the body as views; the rest is parsed as JSON.
            parse = functools.partial(parse_body, paths=protocol.route_text_paths)
            raw = await self._transport.request("POST", protocol.generate_path, body, headers, parse=parse)
        except RemoteGenerateError as exc:
            if exc.status != 404:
                raise
            raise RemoteGenerateError(
                f"{exc} -- nothing answers POST {url}: check base_url (the server root, e.g. "
                f"http://host:port, with no /v1) and server={self.server!r}, which sends "
                f"{protocol.generate_path}{_NOT_FOUND_HINTS.get(self.server, '')}",
                url=url,
                status=404,
                attempts=exc.attempts,
            ) from exc
        try:
            # Large payloads decode on the pool, with the GIL released: the loop keeps serving.
            size = route_text_bytes(raw, protocol.route_text_paths)
            parsed = await off_loop(size, protocol.parse_response, raw, call, self.limits)
        except (TypeError, ValueError, MemoryError, OverflowError) as exc:
            raise RemoteGenerateError(
                f"POST {url}: response breaks the {self.server} format: {exc}", url=url, status=200
            ) from exc
        if parsed.routed_experts is not None and self.moe_layers:
            _warn_zero_layers(parsed.routed_experts, self.moe_layers, url)
        return RemoteGenerateResult(
            **vars(parsed), num_experts=self.limits.num_experts, raw=protocol.without_routes(raw)
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
}


def _transport_config(config: Any, flat: dict[str, Any]) -> TransportConfig:
    """`config` when given (the flat keywords must then be left at their defaults), else one built from them."""
    if config is None:
        return TransportConfig(**flat)
    if not isinstance(config, TransportConfig):
        raise TypeError(f"transport_config must be a TransportConfig, got {type(config).__name__}")
    defaults = TransportConfig()
    changed = sorted(name for name, value in flat.items() if value != getattr(defaults, name))
    if changed:
        raise ValueError(f"give either transport_config= or the keywords {changed}, not both")
    return config


def _check_base_url(base_url: Any) -> str:
    check_str(base_url, "base_url")
    try:
        url = yarl.URL(base_url)
        port = url.port
    except (ValueError, TypeError) as exc:
        raise ValueError(f"base_url {base_url!r} is not a valid URL (bad port?): {exc}") from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    if not url.host:
        raise ValueError(f"base_url has no host: {base_url!r}")
    if url.user is not None or url.password is not None:
        raise ValueError("base_url must not hold credentials (user:password@); send them with headers= instead")
    if url.query_string:
        raise ValueError(
            f"base_url must not have a query string ({url.query_string!r}): the endpoint path is appended to it"
        )
    if url.fragment:
        raise ValueError(f"base_url must not have a fragment ({url.fragment!r})")
    if port is None:  # pragma: no cover - yarl fills the scheme's default
        raise ValueError(f"base_url has no port: {base_url!r}")
    if url.path.rstrip("/").endswith("/v1"):
        # An OpenAI-style base URL: the endpoint paths below already hold their
        # version, so /v1 + /inference/v1/generate would be a path no server has.
        raise ValueError(
            f"base_url {base_url!r} ends in /v1, an OpenAI-style base URL; give the server root "
            f"without /v1 (e.g. {str(url.with_path(url.path.rstrip('/')[:-3] or '/')).rstrip('/')!r}): "
            "the client appends the endpoint's full path"
        )
    return base_url.rstrip("/")


def _check_moe_layers(moe_layers: Any, num_layers: int | None) -> tuple[int, ...]:
    if moe_layers is None:
        return ()
    return check_indices(moe_layers, "moe_layers", limit=num_layers, what="layer")


def _check_salt(salt: Any) -> str | None:
    return None if salt is None else check_cache_salt(salt)


def _check_start(start: Any, prompt_len: int, want_routes: bool) -> int:
    if start is None:
        return 0
    start = check_int(start, "routed_experts_prompt_start")
    if not 0 <= start <= prompt_len:
        raise ValueError(f"routed_experts_prompt_start must be in [0, len(prompt)={prompt_len}], got {start}")
    if not want_routes:
        raise ValueError("routed_experts_prompt_start requires return_routed_experts=True")
    return start


def _warn_zero_layers(routes: np.ndarray, moe_layers: tuple[int, ...], url: str) -> None:
    if routes.shape[0] == 0:
        return
    layers = [layer for layer in moe_layers if layer < routes.shape[1] and not routes[:, layer].any()]
    if layers:
        warnings.warn(
            f"POST {url}: MoE layer(s) {layers} have all-zero routes over {routes.shape[0]} rows; "
            "the server likely did not capture them (check its version and parallel configuration)",
            ZeroRoutesWarning,
            stacklevel=3,
        )


def _token_list(tokens: Any) -> list[int]:
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"prompt_token_ids: expected a 1-D integer array, got {tokens.ndim}-D {tokens.dtype}")
        out = tokens.tolist()
    elif isinstance(tokens, (list, tuple)):
        out = [check_int(t, f"prompt_token_ids[{i}]") for i, t in enumerate(tokens)]
    else:
        raise TypeError(f"prompt_token_ids: expected a list of ints, got {type(tokens).__name__}")
    for i, t in enumerate(out):
        if not 0 <= t < _TOKEN_ID_END:
            raise ValueError(f"prompt_token_ids[{i}] = {t}: token ids must be in [0, 2**63)")
    return out


def _sampling_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise TypeError(f"sampling_params: expected a mapping, got {type(params).__name__}")
    n = params.get("n", 1)
    if n is not None and n != 1:
        # SGLang answers n > 1 with a JSON list and vLLM with one choice per
        # sample: a result holds one sample, so the others would be lost.
        raise ValueError(
            f"sampling_params['n'] = {n!r}: the client asks for one sample per call; "
            "call generate once per sample (with distinct seeds)"
        )
    return dict(params)
