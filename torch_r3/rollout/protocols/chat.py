"""What the chat-completions protocols share: the contract `RemoteGenerateClient.chat` drives, and the message check.

A chat protocol differs from a `ServerProtocol` in one way that matters for
routes: the server renders the messages with its chat template, so the
positions the rows describe are the server's tokens. `parse_response`
therefore returns the rendered prompt's token ids with the parsed answer, and
refuses an answer that does not name them.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from torch_r3.rollout.protocols.base import ParsedResponse, RouteLimits
from torch_r3.rollout.protocols.fields import check_cache_salt

# Serves the client's chat(); users reach a chat protocol by server= name.
__all__ = ["ChatProtocol", "check_messages"]


class ChatProtocol(abc.ABC):
    """One server's `/v1/chat/completions`.

    Attributes:
        name: The `server=` name of `RemoteGenerateClient` whose `chat` uses it.
        path: The endpoint, appended to the base URL.
        route_payload_paths: Where the answer carries its route payload (see `ServerProtocol`).
        route_text_paths: Where the base64 route text sits (read in place by the client).
    """

    name: ClassVar[str]
    path: ClassVar[str]
    route_payload_paths: ClassVar[tuple[tuple[str, ...], ...]] = ()
    route_text_paths: ClassVar[tuple[tuple[str, ...], ...]] = ()

    @staticmethod
    @abc.abstractmethod
    def top_level(params: Mapping[str, Any], want_routes: bool, start: int, model: str | None) -> dict[str, Any]:
        """The body's fields besides `messages`, `logprobs` and `cache_salt`: the caller's and the server's own.

        Raises:
            ValueError: `sampling_params` holds a field the protocol sets itself.
        """

    def request_body(
        self,
        messages: list[dict[str, Any]],
        sampling_params: Mapping[str, Any],
        *,
        return_routed_experts: bool,
        start: int,
        cache_salt: str | None,
        model: str | None,
    ) -> dict[str, Any]:
        """The JSON body: `top_level`'s fields, `messages` as given (checked by `check_messages`),
        `logprobs: true` unless the caller set it, and the checked `cache_salt`.

        Raises:
            ValueError: `sampling_params` holds a field the protocol sets
                itself, or the salt breaks `check_cache_salt`'s rules.
        """
        body = self.top_level(sampling_params, return_routed_experts, start, model)
        body["messages"] = messages
        body.setdefault("logprobs", True)
        if cache_salt is not None:
            body["cache_salt"] = check_cache_salt(cache_salt)
        return body

    @abc.abstractmethod
    def parse_response(
        self, raw: Any, *, return_routed_experts: bool, start: int, limits: RouteLimits
    ) -> tuple[tuple[int, ...], ParsedResponse]:
        """The server's rendered prompt ids and the parsed first choice.

        Raises:
            WireFormatError: The answer lacks the rendered prompt's token ids
                (without them the rows cannot be matched to tokens), breaks the
                format, or `start` is past the rendered prompt.
        """


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of JSON objects with a string `role` (the client's check before sending).

    Raises:
        TypeError: Not a sequence of mappings, or a `role` that is not a string.
        ValueError: No messages.

    Examples:
        >>> check_messages([{"role": "user", "content": "hi"}])
        [{'role': 'user', 'content': 'hi'}]
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of chat messages (objects), got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError(f"messages[{i}] must be an object with a string 'role', got {m!r:.60}")
        out.append(dict(m))
    return out
