"""vLLM's OpenAI-compatible `POST /v1/completions` (token-id prompt) and `POST /v1/chat/completions`, as vLLM 0.33 answers them.

Completions request: `prompt` (token ids), top-level `max_tokens`, `temperature`,
`seed`, `stop_token_ids`, `ignore_eos`, `logprobs`, `n` (1 only),
`return_token_ids`, `return_weight_versions`, `routed_experts_prompt_start` in
`[0, P]`, `cache_salt` (vLLM's rules) and `model`; other fields are ignored, as
vLLM ignores them. Response: `{"id", "object": "text_completion", "model",
"choices": [{"index", "text", "logprobs": {"token_logprobs", "tokens", ...} |
null, "finish_reason", "token_ids", "prompt_token_ids", "routed_experts",
"weight_versions"}], "usage"}`: `routed_experts` is base64 `.npy` as on the
native endpoint; the token ids and the spans come only when asked for.

Chat request: `messages` (rendered server-side by the loopback chat template,
`torch_r3.testing._wire.chat`, so the prompt's token ids are the server's),
`max_completion_tokens` or `max_tokens`, `logprobs` (a bool) and the same
other fields. Response: `{"object": "chat.completion", "choices": [{"message":
{"role": "assistant", "content"}, "logprobs": {"content": [{"token",
"logprob", "bytes", "top_logprobs"}]} | null, "finish_reason", "token_ids",
"routed_experts", "weight_versions"}], "prompt_token_ids", "usage"}`, the
rendered prompt's ids at the top level (with `return_token_ids`), as vLLM sends them.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from torch_r3.rollout.protocols.vllm import RESET_PREFIX_CACHE_PATH
from torch_r3.rollout.protocols.vllm_openai import CHAT_PATH, COMPLETIONS_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    VLLM_SAMPLING,
    WireProtocol,
    chat_prompt,
    check_bool,
    check_int,
    completions_prompt,
    max_tokens,
    vllm_request,
    weight_spans,
)
from torch_r3.testing._wire.chat import tokens_as_text
from torch_r3.testing._wire.vllm import npy_bytes
from torch_r3.testing.model import ServedModel

__all__ = ["VLLMCompletionsWire"]

_SAMPLING = VLLM_SAMPLING  # the same names as vLLM's native endpoint


class VLLMCompletionsWire(WireProtocol):
    """vLLM's `/v1/completions` and `/v1/chat/completions` (see the module docstring)."""

    name = "vllm-openai"
    generate_path = COMPLETIONS_PATH
    chat_path = CHAT_PATH
    flush_cache_path = RESET_PREFIX_CACHE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt, logprobs = completions_prompt(body)
        params = {name: body[k] for k, name in _SAMPLING.items() if body.get(k) is not None}
        return self._request(body, prompt, params, logprobs)

    def parse_chat(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = chat_prompt(body, model)
        params = {name: body[k] for k, name in _SAMPLING.items() if k != "max_tokens" and body.get(k) is not None}
        return self._request(
            body, prompt, {**params, **max_tokens(body)}, check_bool(body.get("logprobs", False), "logprobs")
        )

    def _request(
        self, body: Mapping[str, Any], prompt: list[int], params: dict[str, Any], logprobs: bool
    ) -> GenerateRequest:
        check_int(body.get("n", 1), "n", 1, 1)
        start = check_int(body.get("routed_experts_prompt_start", 0), "routed_experts_prompt_start", 0, len(prompt))
        options = {
            "logprobs": logprobs,
            "token_ids": check_bool(body.get("return_token_ids", False), "return_token_ids"),
            "spans": check_bool(body.get("return_weight_versions", False), "return_weight_versions"),
            "model": body.get("model") or "loopback",
        }
        return vllm_request(body, prompt, params, start, options)

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        text = {"text": tokens_as_text(generation.token_ids)}
        logprobs = _completion_logprobs(generation) if request.options["logprobs"] else None
        choice, rows = self._choice(request, generation, model, malformed, text, logprobs)
        choice["prompt_token_ids"] = request.prompt if request.options["token_ids"] else None
        return _response("cmpl", "text_completion", request, generation, choice), rows

    def render_chat(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        message = {"message": {"role": "assistant", "content": tokens_as_text(generation.token_ids)}}
        logprobs = _chat_logprobs(generation) if request.options["logprobs"] else None
        choice, rows = self._choice(request, generation, model, malformed, message, logprobs)
        body = _response("chatcmpl", "chat.completion", request, generation, choice)
        body["prompt_token_ids"] = request.prompt if request.options["token_ids"] else None  # top level in chat
        return body, rows

    def _choice(
        self,
        request: GenerateRequest,
        generation: Generation,
        model: ServedModel,
        malformed: bool,
        content: dict[str, Any],
        logprobs: dict[str, Any] | None,
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """One choice: its `content` (the text or the message), `logprobs`, the finish reason, the
        token ids, the routes as base64 `.npy` and the weight spans (the last three when asked for)."""
        rows = payload = None
        if self.routes_enabled and generation.routes is not None:
            dtype = np.dtype("<u1") if model.num_experts <= 256 else np.dtype("<u2")
            rows = np.ascontiguousarray(generation.routes[request.start :], dtype=dtype)
            claim = rows.shape[0] + 1 if malformed else None
            payload = base64.b64encode(npy_bytes(rows, claim_rows=claim)).decode("ascii")
        return {
            "index": 0,
            **content,
            "logprobs": logprobs,
            "finish_reason": generation.finish_reason,
            "token_ids": generation.token_ids if request.options["token_ids"] else None,
            "routed_experts": payload,
            "weight_versions": weight_spans(generation) if request.options["spans"] else None,
        }, rows


def _completion_logprobs(generation: Generation) -> dict[str, Any]:
    out = generation.token_ids
    return {
        "text_offset": list(range(len(out))),
        "token_logprobs": list(generation.logprobs),
        "tokens": [f"token_id:{t}" for t in out],
        "top_logprobs": [None] * len(out),
    }


def _chat_logprobs(generation: Generation) -> dict[str, Any]:
    return {
        "content": [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(generation.token_ids, generation.logprobs)
        ]
    }


def _response(
    prefix: str, kind: str, request: GenerateRequest, generation: Generation, choice: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "model": request.options["model"],
        "choices": [choice],
        "usage": _usage(request, generation),
    }


def _usage(request: GenerateRequest, generation: Generation) -> dict[str, int]:
    p, o = len(request.prompt), len(generation.token_ids)
    return {"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}
