"""What each engine needs switched on before it returns routes, version by version.

One home for the advice every missing-routes error gives: the client's
protocols (a `null` or missing route payload) and the in-process adapters
(`CompletionOutput.routed_experts is None`) append `missing_routes_hint(engine)`.
"""

from __future__ import annotations

__all__ = ["missing_routes_hint"]

_VLLM = (
    "vLLM 0.22-0.30: start it with --enable-return-routed-experts (before 0.22, routes come in process only: "
    "LLM(..., enable_return_routed_experts=True), from 0.14); vLLM 0.31+: --enable-return-routed-experts or "
    '--aux-output-config \'{"enable_return_routed_experts": true, "max_bytes": N}\' (in process: '
    "LLM(..., enable_return_routed_experts=True) or aux_output_config=AuxOutputConfig("
    "enable_return_routed_experts=True, max_bytes=N)); 0.31+ also needs Model Runner V2 "
    "(VLLM_USE_V2_MODEL_RUNNER=1), prefix caching and a MoE generate model, and refuses to start with it "
    "under pipeline parallelism (PP > 1) or context parallelism (DCP/PCP > 1). There is no per-request "
    "switch: a server without it returns routed_experts null"
)
_SGLANG = (
    "SGLang: start the server with --enable-return-routed-experts (the request's return_routed_experts: true "
    "is sent by the client); routed_experts_start_len is honoured from 0.5.12 on (0.5.10.post1 and 0.5.11 "
    "return every row, which the client slices)"
)
_MEGATRON = (
    "Megatron-core's inference server: build the model with moe_enable_routing_replay=True "
    "(--moe-enable-routing-replay); the dynamic engine refuses it with asynchronous scheduling"
)
_SKYRL = (
    "SkyRL: set enable_return_routed_experts (it needs moe_enable_routing_replay), which starts its vLLM server "
    "with routes on; " + _VLLM
)
_HINTS = {
    "skyrl": _SKYRL,
    "megatron": _MEGATRON,
    "vllm": _VLLM,
    "sglang": _SGLANG,
    "torch_r3": "the torch_r3 server: return_routed_experts was sent; the server answered without routes",
}


def missing_routes_hint(engine: str) -> str:
    """The switches `engine` (`"vllm"`, `"sglang"`, `"torch_r3"`) needs to return routes, as one sentence.

    Examples:
        >>> missing_routes_hint("sglang").startswith("SGLang: start the server with --enable-return-routed-experts")
        True
    """
    return _HINTS.get(engine, f"{_VLLM}. {_SGLANG}")
