"""The small Megatron MoE model the replay set-up benchmarks install routes into (`frameworks`, `replay_overhead`).

Tiny widths: what these benchmarks time is the routes' set-up, not the model's
compute, so only the router count, the experts and `topk` follow the case.
"""

from __future__ import annotations

import torch

__all__ = ["worker_model"]


def worker_model(layers: int, experts: int, topk: int, max_tokens: int = 8192):
    """A GPTModel with `layers` MoE routers (tiny widths: the set-up cost is the routes', not the model's)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=16,
        ffn_hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        add_bias_linear=False,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=max_tokens)
