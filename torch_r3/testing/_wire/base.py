"""What every protocol of the loopback server implements, and the checks they share.

A protocol turns a JSON request body into a `GenerateRequest` (raising
`ValueError`/`TypeError`, answered `400`) and a `Generation` into the JSON body
its real server would send. Request checks are strict: a field of the wrong
type or out of range is refused with a message naming it, never cast.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

# Aliased: this module's own check_bool checks JSON request fields (no NumPy bools on the wire).
from torch_r3._checks import check_bool as check_flag, check_instance
from torch_r3.rollout.codec import encode_routes
from torch_r3.rollout.protocols.fields import MAX_SALT_CHARS, SALT_FORBIDDEN
from torch_r3.routes import compact_routes
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.chat import render_messages
from torch_r3.testing.model import ServedModel

__all__ = [
    "VLLM_SAMPLING",
    "WireProtocol",
    "check_body",
    "check_bool",
    "check_int",
    "check_known",
    "check_object",
    "check_salt",
    "chat_prompt",
    "check_token_ids",
    "completions_prompt",
    "max_tokens",
    "routes_envelope",
    "vllm_request",
    "vllm_sampling",
    "weight_spans",
]


class WireProtocol(abc.ABC):
    """One server's request and response format.

    Attributes:
        name: The protocol's name (`LoopbackServer(protocol=name)`).
        generate_path: The generate endpoint (`POST`).
        flush_cache_path: The endpoint that drops the prefix cache (`POST`), if any.
        chat_path: The chat-completions endpoint (`POST`), if the protocol has one:
            then `parse_chat` and `render_chat` serve it.
        default_block_size: Tokens per prefix-cache block of the real server.

    Args:
        routes_enabled: `False` answers like a server launched without its
            routed-experts flag.
    """

    name: ClassVar[str]
    generate_path: ClassVar[str]
    flush_cache_path: ClassVar[str | None] = None
    chat_path: ClassVar[str | None] = None
    default_block_size: ClassVar[int] = 16

    def __init__(self, *, routes_enabled: bool = True) -> None:
        self.routes_enabled = check_flag(routes_enabled, "routes_enabled")

    @abc.abstractmethod
    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        """Check a request body and turn it into a `GenerateRequest`.

        Raises:
            TypeError: A field has the wrong type.
            ValueError: A field is missing, unknown or out of range.
        """

    @abc.abstractmethod
    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """The `200` response body, and the route array it carries (for the stats).

        Args:
            request: The parsed request.
            generation: What the engine produced.
            model: The served model (its shape).
            malformed: Corrupt the route payload so its size disagrees with its shape.

        Returns:
            `(body, routes)`: the JSON-ready body and the routes in the dtype put
            on the wire (`None` when the body carries none).
        """

    def parse_chat(self, body: Any, model: ServedModel) -> GenerateRequest:
        """Check a chat request body and render its messages into the prompt (`chat_path` only).

        Raises:
            TypeError: A field has the wrong type.
            ValueError: A field is missing or out of range (or the protocol has no chat endpoint).
        """
        raise ValueError(f"{self.name} has no chat endpoint")

    def render_chat(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """The `200` chat response body and the route array it carries, as `render` (`chat_path` only)."""
        raise ValueError(f"{self.name} has no chat endpoint")

    def error(self, status: int, message: str) -> dict[str, Any]:
        """The JSON body of an error response."""
        return {"error": {"message": message}}


def check_body(body: Any, ids_field: str, fields: frozenset[str] | None, *, hint: str = "") -> list[int]:
    """Check a request body: an object holding the prompt in `ids_field`, and, when
    `fields` is given, no field outside it. Returns the prompt."""
    check_object(body, "request body")
    if ids_field not in body:
        raise ValueError(f"request body is missing {ids_field!r}{hint}")
    if fields is not None:
        check_known(body, fields, "unknown request fields")
    return check_token_ids(body[ids_field], ids_field)


def check_known(mapping: Mapping[str, Any], known: Any, what: str) -> None:
    """`ValueError` starting with `what` that lists the keys of `mapping` not in `known`."""
    unknown = sorted(set(mapping) - set(known))
    if unknown:
        raise ValueError(f"{what} {unknown}; supported: {sorted(known)}")


def check_object(value: Any, name: str) -> Mapping[str, Any]:
    """`value` if it is a JSON object, else `TypeError` naming `name`."""
    return check_instance(value, name, Mapping, "a JSON object")


def check_bool(value: Any, name: str) -> bool:
    """`value` if it is a bool, else `TypeError` naming `name`."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_int(value: Any, name: str, low: int, high: int) -> int:
    """`value` if it is an int (not a bool) in `[low, high]`, else `ValueError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def check_token_ids(value: Any, name: str) -> list[int]:
    """`value` if it is a list of ints, else `TypeError` naming `name`."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"{name} must be a list of ints")
    return value


def check_salt(value: Any, name: str, *, vllm_rules: bool = False) -> str | None:
    """A cache salt: absent (`None`) or a non-empty string; with `vllm_rules`,
    also at most 128 characters without `@`, `/`, `\\` or NUL, as vLLM 0.30+ requires."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must be a non-empty string when given")
    if vllm_rules:
        if len(value) > MAX_SALT_CHARS:
            raise ValueError(f"{name} must be at most {MAX_SALT_CHARS} characters, got {len(value)}")
        if any(c in value for c in SALT_FORBIDDEN):
            raise ValueError(f"{name} must not contain '@', '/', '\\' or NUL")
    return value


def chat_prompt(body: Any, model: ServedModel) -> list[int]:
    """The prompt of a chat request body: its `messages` rendered by the loopback chat template."""
    check_object(body, "request body")
    if "messages" not in body:
        raise ValueError("request body is missing 'messages'")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ValueError(f"the chat endpoint renders messages into token ids: {type(model).__name__} has no vocab_size")
    return render_messages(body["messages"], vocab)


def max_tokens(body: Mapping[str, Any]) -> dict[str, Any]:
    """`max_new_tokens` from a chat body's `max_completion_tokens` or (deprecated in OpenAI's API) `max_tokens`."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return {"max_new_tokens": body[key]}
    return {}


def weight_spans(generation: Generation) -> list[dict[str, Any]]:
    """The `weight_versions` spans of a generation: one version generated every token here."""
    return [{"version": generation.weight_version, "start": 0, "end": len(generation.token_ids)}]


VLLM_SAMPLING: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
"""vLLM's sampling parameters -> the model's, as vLLM's endpoints (and SkyRL's, vLLM underneath) name them."""


def completions_prompt(body: Any) -> tuple[list[int], bool]:
    """An OpenAI-style completions body's token-id `prompt`, and whether it asks for `logprobs` (an int in [0, 20])."""
    prompt = check_body(body, "prompt", None)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        check_int(logprobs, "logprobs", 0, 20)
    return prompt, logprobs is not None


def vllm_sampling(
    body: Mapping[str, Any], prompt: list[int], table: Mapping[str, str | None]
) -> tuple[Mapping[str, Any], dict[str, Any], int]:
    """A vLLM-style body's `sampling_params`: the object itself (only `table`'s keys), the model's
    sampling parameters (`table` maps each name to the model's; `None`: read by the caller, not
    passed on) and the routes' `routed_experts_prompt_start` in `[0, P]`."""
    raw = body.get("sampling_params") or {}
    check_known(check_object(raw, "sampling_params"), table, "unsupported sampling_params")
    start = check_int(raw.get("routed_experts_prompt_start", 0), "routed_experts_prompt_start", 0, len(prompt))
    params = {name: v for k, v in raw.items() if (name := table[k]) is not None and v is not None}
    return raw, params, start


def vllm_request(
    body: Mapping[str, Any], prompt: list[int], params: dict[str, Any], start: int, options: dict[str, Any]
) -> GenerateRequest:
    """A request to a vLLM server: routes come back always (a server-wide flag in vLLM, not a
    request field), and the `cache_salt` follows vLLM's rules."""
    return GenerateRequest(
        prompt=prompt,
        sampling_params=params,
        return_routes=True,
        start=start,
        salt=check_salt(body.get("cache_salt"), "cache_salt", vllm_rules=True),
        options=options,
    )


def routes_envelope(
    wire: WireProtocol, request: GenerateRequest, generation: Generation, malformed: bool
) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """The rows from the request's start, compacted, and their torch_r3 envelope (`None`, `None`
    when no routes go out); `malformed` claims one row more than the data holds."""
    if not (request.return_routes and wire.routes_enabled and generation.routes is not None):
        return None, None
    rows = compact_routes(generation.routes[request.start :], health=None)
    envelope = encode_routes(rows)
    if malformed:
        envelope["shape"][0] += 1
    return rows, envelope
