"""What each engine-health finding names as its likely cause: the engine settings and fixes to look at.

One home for the hint texts of `torch_r3.health`'s findings (by engine for
zero rows) and for `ZERO_ROUTES_HINT`, the causes of all-zero routes that the
hooks' repeated-id error names.
"""

from __future__ import annotations

__all__ = ["CONSTANT_HINT", "REPLAY_HINT", "STALE_HINT", "ZERO_HINTS", "ZERO_ROUTES_HINT"]

# The engine settings each signature points at, by engine (None: any engine).
ZERO_HINTS = {
    "vllm": (
        "vLLM's fused FlashInfer (monolithic) MoE kernels route inside the kernel and bypass route capture: "
        "start vLLM with --moe-backend triton (or a release whose monolithic kernel fills routing_replay_out); "
        "vLLM-Ascend 0.26 has the same symptom; pipeline parallelism (refused by vLLM 0.33 with routes) "
        "leaves other stages' layers zero"
    ),
    "sglang": (
        "SGLang with prefill/decode disaggregation sent all-zero prompt rows before sgl-project/sglang#23885: "
        "upgrade; with pipeline parallelism a stage that captured nothing leaves its layers zero"
    ),
    None: (
        "the engine did not capture this layer: vLLM's FlashInfer monolithic MoE kernels (use --moe-backend triton), "
        "SGLang prefill/decode disaggregation before sgl-project/sglang#23885, or a pipeline stage that captured "
        "nothing; if the layer is dense, leave it out of moe_layers"
    ),
}
#: The causes of all-zero routes, for messages outside this module (the hooks' repeated-id error).
ZERO_ROUTES_HINT = (
    "vLLM's FlashInfer monolithic MoE kernels skip capture (start vLLM with --moe-backend triton), SGLang "
    "prefill/decode disaggregation before sgl-project/sglang#23885, or a pipeline stage that captured nothing"
)
CONSTANT_HINT = (
    "a capture slot written once and never updated; run the engine without CUDA graphs "
    "(vLLM --enforce-eager, SGLang --disable-cuda-graph) to confirm, and report it to the engine"
)
REPLAY_HINT = (
    "capture slots this request reused still held an earlier request's rows (SGLang's padded capture slots, "
    "before sgl-project/sglang#36404): upgrade SGLang; run without CUDA graphs (SGLang --disable-cuda-graph, "
    "vLLM --enforce-eager) to confirm"
)
STALE_HINT = (
    "padded capture slots that kept a row from an earlier forward (SGLang before sgl-project/sglang#36404, "
    "at chunked-prefill boundaries): upgrade SGLang; with vLLM, run with --enforce-eager to confirm"
)
