"""SkyRL's `POST /skyrl/v1/generate`, as SkyRL 0.4's vLLM server actor answers it.

Request: `token_ids`, `sampling_params` (vLLM's names: `max_tokens`,
`temperature`, `seed`, `stop_token_ids`, `ignore_eos`, `logprobs`,
`routed_experts_prompt_start`), `cache_salt`, `model`. Response:
`{"choices": [{"token_ids", "finish_reason", "logprobs": {"content": [{"logprob"}]} | null,
"routed_experts": {"data", "shape", "dtype"} | null, "rollout_sample_support": null}]}`,
the routes compacted to `uint8` / `int16` / `int32` (the torch_r3 envelope).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torch_r3.rollout.protocols.skyrl import GENERATE_PATH
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import (
    VLLM_SAMPLING,
    WireProtocol,
    check_body,
    routes_envelope,
    vllm_request,
    vllm_sampling,
)
from torch_r3.testing.model import ServedModel

__all__ = ["SkyRLWire"]

# SkyRL's sampling parameters (vLLM's) -> the model's (None: read here, not passed on).
_SAMPLING: dict[str, str | None] = {**VLLM_SAMPLING, "logprobs": None, "routed_experts_prompt_start": None}


class SkyRLWire(WireProtocol):
    """SkyRL's `/skyrl/v1/generate` (see the module docstring)."""

    name = "skyrl"
    generate_path = GENERATE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "token_ids", None)
        raw, params, start = vllm_sampling(body, prompt, _SAMPLING)
        return vllm_request(body, prompt, params, start, {"logprobs": raw.get("logprobs") is not None})

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        rows, envelope = routes_envelope(self, request, generation, malformed)  # return_routes: always
        logprobs = None
        if request.options["logprobs"]:
            logprobs = {"content": [{"logprob": lp} for lp in generation.logprobs]}
        choice = {
            "token_ids": generation.token_ids,
            "finish_reason": generation.finish_reason,
            "logprobs": logprobs,
            "routed_experts": envelope,
            "rollout_sample_support": None,
        }
        return {"choices": [choice]}, rows
