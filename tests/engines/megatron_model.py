"""A Megatron-core GPTModel holding a tiny Qwen3-MoE checkpoint's weights (`tests.engines.megatron_model`).

`qwen3_megatron(hf_model)` builds the Megatron model of the `transformers` Qwen3-MoE model
`hf_model` (RMSNorm, per-head q/k RMSNorm, grouped-query attention, RoPE, SwiGLU experts,
softmax top-k router normalized over the chosen experts, untied output layer) on the local
(no Transformer Engine) spec with the allgather dispatcher and routing replay enabled, and
copies every weight over: the fused `linear_qkv` is the query heads of each key/value group
followed by that group's key and value, each expert's `linear_fc1` is its `gate_up_proj`
(gate first, as Megatron's gated linear unit splits it). Needs Megatron's parallel state
initialized and, on a CPU, `torch_r3.megatron._cpu.megatron_on_cpu`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["qwen3_megatron"]


def qwen3_megatron(hf_model: torch.nn.Module, *, max_sequence_length: int = 512) -> Any:
    """The Megatron model of `hf_model` (a `Qwen3MoeForCausalLM`), its weights copied (see the module docstring)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    c = hf_model.config
    if c.model_type != "qwen3_moe" or c.mlp_only_layers or c.decoder_sparse_step != 1 or not c.norm_topk_prob:
        raise ValueError("qwen3_megatron converts Qwen3-MoE models with every layer MoE and norm_topk_prob=True")
    config = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        num_moe_experts=c.num_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # top-k of the logits, softmax over those: Qwen3's normalized top-k
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=c.vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(c.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=False,
    )
    model.load_state_dict(_state_dict(hf_model), strict=False)
    _check_every_weight_copied(model, hf_model)
    return model.eval()


def _state_dict(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    c = hf.config
    group = c.num_attention_heads // c.num_key_value_heads
    out = {
        "embedding.word_embeddings.weight": hf.model.embed_tokens.weight,
        "decoder.final_layernorm.weight": hf.model.norm.weight,
        "output_layer.weight": hf.lm_head.weight,
    }
    for i, layer in enumerate(hf.model.layers):
        at, mlp, pre = layer.self_attn, layer.mlp, f"decoder.layers.{i}."
        q = at.q_proj.weight.reshape(c.num_key_value_heads, group * c.head_dim, -1)
        k = at.k_proj.weight.reshape(c.num_key_value_heads, c.head_dim, -1)
        v = at.v_proj.weight.reshape(c.num_key_value_heads, c.head_dim, -1)
        out[pre + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, c.hidden_size)
        out[pre + "self_attention.linear_proj.weight"] = at.o_proj.weight
        out[pre + "self_attention.q_layernorm.weight"] = at.q_norm.weight
        out[pre + "self_attention.k_layernorm.weight"] = at.k_norm.weight
        out[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[pre + "pre_mlp_layernorm.weight"] = layer.post_attention_layernorm.weight
        out[pre + "mlp.router.weight"] = mlp.gate.weight
        for e in range(c.num_experts):
            expert = f"{pre}mlp.experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = mlp.experts.gate_up_proj[e]
            out[expert + "linear_fc2.weight"] = mlp.experts.down_proj[e]
    return {k: v.detach().clone() for k, v in out.items()}


def _check_every_weight_copied(model: torch.nn.Module, hf: torch.nn.Module) -> None:
    copied = set(_state_dict(hf))
    missing = [n for n, _ in model.named_parameters() if n not in copied]
    if missing:
        raise ValueError(f"Megatron parameters without a Qwen3-MoE weight: {missing}")
