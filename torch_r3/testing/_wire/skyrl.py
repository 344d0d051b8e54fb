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

from torch_r3.rollout.codec import encode_routes
from torch_r3.rollout.protocols.skyrl import GENERATE_PATH
from torch_r3.routes import compact_routes
from torch_r3.testing._engine import GenerateRequest, Generation
from torch_r3.testing._wire.base import WireProtocol, check_body, check_int, check_known, check_object, check_salt
from torch_r3.testing.model import ServedModel

__all__ = ["SkyRLWire"]

_SAMPLING: dict[str, str | None] = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "seed": "seed",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "logprobs": None,
    "routed_experts_prompt_start": None,
}


class SkyRLWire(WireProtocol):
    """SkyRL's `/skyrl/v1/generate` (see the module docstring)."""

    name = "skyrl"
    generate_path = GENERATE_PATH

    def parse(self, body: Any, model: ServedModel) -> GenerateRequest:
        prompt = check_body(body, "token_ids", None)
        raw = body.get("sampling_params") or {}
        check_known(check_object(raw, "sampling_params"), _SAMPLING, "unsupported sampling_params")
        start = check_int(raw.get("routed_experts_prompt_start", 0), "routed_experts_prompt_start", 0, len(prompt))
        params = {name: v for k, v in raw.items() if (name := _SAMPLING[k]) is not None and v is not None}
        return GenerateRequest(
            prompt=prompt,
            sampling_params=params,
            return_routes=True,
            start=start,
            salt=check_salt(body.get("cache_salt"), "cache_salt", vllm_rules=True),
            options={"logprobs": raw.get("logprobs") is not None},
        )

    def render(
        self, request: GenerateRequest, generation: Generation, model: ServedModel, *, malformed: bool = False
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        rows = envelope = None
        if self.routes_enabled and generation.routes is not None:
            rows = compact_routes(generation.routes[request.start :], health=None)
            envelope = encode_routes(rows)
            if malformed:
                envelope["shape"][0] += 1
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
