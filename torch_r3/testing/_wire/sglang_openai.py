"""SGLang's OpenAI-compatible `POST /v1/completions` (token-id prompt) and `POST /v1/chat/completions`, as sglang 0.5.23 answers them.

Request fields: `prompt` (token ids; completions) or `messages` (chat,
rendered server-side by the loopback chat template, so the prompt's token ids
are the server's), `max_tokens` (completions, default 16) or
`max_completion_tokens` / `max_tokens` (chat), `temperature`, `seed`,
`stop_token_ids`, `ignore_eos`, `logprobs` (an int for completions, a bool for
chat), `n` (1 only), `return_token_ids`, `return_routed_experts`,
`routed_experts_start_len` in `[0, P]`, `cache_salt` and `extra_key` (both key
the prefix cache), `model`; other fields are ignored, as SGLang's pydantic
request classes ignore them.

Response, as SGLang's `_build_completion_response` / `_build_chat_response`
build it: `choices[0]` with `text` (completions) or `message` (chat),
`logprobs` (completions: `{"text_offset", "token_logprobs", "tokens",
"top_logprobs"}`; chat: `{"content": [{"token", "bytes", "logprob",
"top_logprobs"}]}`; a non-finite log-prob written `null`), `finish_reason` (a
string), `matched_stop`, and with `return_token_ids` the token ids
(completions: `token_ids`, `prompt_token_ids`; chat: `prompt_token_ids`,
`response_token_ids`); the response-level `metadata` (`weight_version`,
`weight_versions`) and `sglext.routed_experts`: base64 of the flat
little-endian int32 rows `[start, P + O - 1)`, as `/generate` sends them.
`sglext` is absent when no routes were asked for (or the server runs without
`--enable-return-routed-experts`).
"""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3.rollout.protocols.sglang import FLUSH_CACHE_PATH
from torch_r3.rollout.protocols.sglang_openai import CHAT_PATH, COMPLETIONS_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    WireProtocol,
    chat_prompt,
    check_bool,
    check_int,
    check_salt,
    completions_prompt,
    max_tokens,
    weight_spans,
)
from torch_r3.testing._wire.chat import tokens_as_text
from torch_r3.testing.model import ServedModel

__all__ = ["SGLangCompletionsWire"]

_SAMPLING = {
    "temperature": "temperature",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}


class SGLangCompletionsWire(WireProtocol):
    """SGLang's `/v1/completions` and `/v1/chat/completions` (see the module docstring)."""

    name = "sglang-openai"
    generate_path = COMPLETIONS_PATH
    chat_path = CHAT_PATH
    flush_cache_path = FLUSH_CACHE_PATH
    default_block_size = 1  # a radix tree with page size 1 matches any prefix length

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt, logprobs = completions_prompt(body)
        params = {"max_new_tokens": body.get("max_tokens", 16), **_sampling(body)}
        return self._request(body, prompt, params, logprobs)

    def parse_chat(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = chat_prompt(body, model)
        params = {**_sampling(body), **max_tokens(body)}
        return self._request(body, prompt, params, check_bool(body.get("logprobs", False), "logprobs"))

    def _request(
        self, body: Mapping[str, Any], prompt: list[int], params: dict[str, Any], logprobs: bool
    ) -> GenerateRequest:
        check_int(body.get("n", 1), "n", 1, 1)
        if body.get("stream", False) is not False:
            raise ValueError("stream must be false: this server does not stream")
        start = check_int(body.get("routed_experts_start_len", 0), "routed_experts_start_len", 0, len(prompt))
        keys = [check_salt(body.get(k), k) for k in ("extra_key", "cache_salt")]
        return GenerateRequest(
            prompt=prompt,
            sampling_params=params,
            return_routes=check_bool(body.get("return_routed_experts", False), "return_routed_experts"),
            start=start,
            salt=None if keys == [None, None] else repr(keys),
            options={
                "logprobs": logprobs,
                "token_ids": check_bool(body.get("return_token_ids", False), "return_token_ids"),
                "model": body.get("model") or "default",
            },
        )

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        out = generation.token_ids
        logprobs = _completion_logprobs(generation) if request.options["logprobs"] else None
        ids = {"token_ids": out, "prompt_token_ids": request.prompt}
        return self._response(
            "text_completion", {"text": tokens_as_text(out)}, logprobs, ids, request, generation, malformed
        )

    def render_chat(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        out = generation.token_ids
        message = {"role": "assistant", "content": tokens_as_text(out), "reasoning_content": None}
        logprobs = _chat_logprobs(generation) if request.options["logprobs"] else None
        ids = {"prompt_token_ids": request.prompt, "response_token_ids": out}
        return self._response("chat.completion", {"message": message}, logprobs, ids, request, generation, malformed)

    def _response(
        self,
        kind: str,
        content: dict[str, Any],
        logprobs: dict[str, Any] | None,
        ids: dict[str, Any],
        request: GenerateRequest,
        generation: Generation,
        malformed: bool,
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """The response around one choice: its `content` (the text or the message), `logprobs`,
        the finish reason, and the token `ids` when the request asked for them."""
        choice = {
            "index": 0,
            **content,
            "logprobs": logprobs,
            **_finish(generation),
            **(ids if request.options["token_ids"] else {}),
        }
        p, o = len(request.prompt), len(generation.token_ids)
        body: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "object": kind,
            "created": 0,
            "model": request.options["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": p, "total_tokens": p + o, "completion_tokens": o},
            "metadata": {"weight_version": generation.weight_version, "weight_versions": weight_spans(generation)},
        }
        rows = None
        if request.return_routes and self.routes_enabled and generation.routes is not None:
            rows = np.ascontiguousarray(generation.routes[request.start :], dtype="<i4")
            data = rows.tobytes()
            if malformed:  # one id short: the length is no longer a whole number of rows
                data = data[: -rows.itemsize]
            body["sglext"] = {"routed_experts": base64.b64encode(data).decode("ascii")}
        return body, rows


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    return {name: body[k] for k, name in _SAMPLING.items() if body.get(k) is not None}


def _completion_logprobs(generation: Generation) -> dict[str, Any]:
    out = generation.token_ids
    return {
        "text_offset": [-1] * len(out),
        "token_logprobs": _logprobs(generation),
        "tokens": [tokens_as_text([t]) for t in out],
        "top_logprobs": [],
    }


def _chat_logprobs(generation: Generation) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": tokens_as_text([t]),
                "bytes": list(tokens_as_text([t]).encode()),
                "logprob": lp,
                "top_logprobs": [],
            }
            for t, lp in zip(generation.token_ids, _logprobs(generation))
        ]
    }


def _logprobs(generation: Generation) -> list[float | None]:
    # SGLang's JSON writes a non-finite log-prob (-inf, NaN) as null.
    return [lp if math.isfinite(lp) else None for lp in generation.logprobs]


def _finish(generation: Generation) -> dict[str, Any]:
    reason = generation.finish_reason
    matched = generation.token_ids[-1] if reason == "stop" and generation.token_ids else None
    return {"finish_reason": reason, "matched_stop": matched}
