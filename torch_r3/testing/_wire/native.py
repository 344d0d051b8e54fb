"""The loopback server's own format: `POST /v1/generate` with a route envelope per choice.

Request: `token_ids`, `sampling_params` (handed to the model as they are, with
`routed_experts_prompt_start` = the first route row), `return_routed_experts`,
optional `model`, and optional `cache_salt`, a non-empty string that keys the
prefix cache apart (requests share cached blocks only with an equal salt).

Response: `{"choices": [{"token_ids", "finish_reason", "logprobs",
"routed_experts"}], "weight_version"}`, where `routed_experts` is the codec's
envelope (`{"data", "shape", "dtype"}`) of rows `[start, P + O - 1)` over every
hidden layer, or `null` when not requested or the request was aborted, and
`weight_version` is the server's weight version (a string).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.protocols.native import GENERATE_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    WireProtocol,
    check_body,
    check_bool,
    check_int,
    check_object,
    check_salt,
    routes_envelope,
)
from torch_r3.testing.model import ServedModel

__all__ = ["TorchR3Wire"]


_FIELDS = frozenset({"token_ids", "sampling_params", "return_routed_experts", "model", "cache_salt"})


class TorchR3Wire(WireProtocol):
    """Our own format (see the module docstring)."""

    name = "torch_r3"
    generate_path = GENERATE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "token_ids", _FIELDS)
        params = body.get("sampling_params") or {}
        check_object(params, "sampling_params")
        want_routes = check_bool(body.get("return_routed_experts", False), "return_routed_experts")
        if "model" in body and not isinstance(body["model"], str):
            raise TypeError("model must be a string")
        start = check_int(params.get("routed_experts_prompt_start", 0), "routed_experts_prompt_start", 0, len(prompt))
        if "routed_experts_prompt_start" in params and not want_routes:
            raise ValueError("routed_experts_prompt_start requires return_routed_experts=true")
        salt = check_salt(body.get("cache_salt"), "cache_salt")
        return GenerateRequest(
            prompt=prompt, sampling_params=dict(params), return_routes=want_routes, start=start, salt=salt
        )

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        rows, envelope = routes_envelope(self, request, generation, malformed)
        choice = {
            "token_ids": generation.token_ids,
            "finish_reason": generation.finish_reason,
            "logprobs": generation.logprobs,
            "routed_experts": envelope,
        }
        return {"choices": [choice], "weight_version": generation.weight_version}, rows
