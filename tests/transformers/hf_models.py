"""Tiny random `transformers` MoE models, one per supported family (no weights are downloaded), and batches for them."""

from __future__ import annotations

import torch

from tests.samples import route_samples
from torch_r3 import R3Collator

LENGTHS = (6, 4)  # two trajectories: left padding in row 1

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


DSA_COMMON = dict(
    {**COMMON, "num_key_value_heads": 4},
    num_hidden_layers=3,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_topk=3,
    index_n_heads=2,
    index_head_dim=16,
)


def _config(family: str):
    import transformers as tf

    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2)
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        )
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(
            **COMMON,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
        )
    if family == "glm4_moe_lite":
        return tf.Glm4MoeLiteConfig(
            **{**COMMON, "num_key_value_heads": 4},
            num_hidden_layers=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=False,
            first_k_dense_replace=0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if family in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek Sparse Attention: index_topk 3 < the batch's lengths, so the indexer really selects.
        dsa = dict(DSA_COMMON)
        if family == "glm_moe_dsa":
            dsa.update(index_topk_freq=2, index_skip_topk_offset=1)  # layers full, shared, full
            return tf.GlmMoeDsaConfig(**dsa)
        return tf.DeepseekV32Config(**dsa)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(
            **COMMON,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        )
    raise KeyError(family)


FAMILY_NAMES = (
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "qwen3_5_moe",
    "deepseek_v32",
    "glm_moe_dsa",
)


def build(family: str, seed: int = 0, dtype=torch.float32):
    """A tiny causal LM of `family` with random weights (router weights, bias and correction bias too)."""
    import transformers as tf

    config = _config(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "router.bias")):
                p.normal_(0, 1.0)  # routers initialised to zero would tie every expert
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    return model.eval()


def make_batch(hook, *, lengths=LENGTHS, seed=0, layers="all", layout="padded"):
    """A real R3Collator batch: random distinct experts, the last token of each trajectory uncaptured."""
    moe = list(hook.layers)
    samples = route_samples(
        seed,
        lengths,
        captured="all_but_last",
        num_layers=hook.num_layers if layers == "all" else len(moe),
        topk=hook.topk,
        num_experts=hook.num_experts,
        moe_layers=moe if layers == "all" else None,  # dense layers keep zero rows
        token_ids=(3, 64),
    )
    return R3Collator(pad_token_id=0, layout=layout)(samples)


def forced(hook, batch):
    """Per MoE layer, the batch's experts as the router sees them (`[B*T, K]`, batch-major)."""
    routes = batch["rollout_expert_indices"]
    if routes.ndim == 3:
        routes = routes.unsqueeze(0)
    columns = range(len(hook.layers)) if routes.shape[2] != hook.num_layers else hook.layers
    return [routes[:, :, c].reshape(-1, hook.topk).long() for c in columns]


def inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def router_weights(model):
    return {n: p for n, p in model.named_parameters() if n.endswith((".mlp.gate.weight", ".mlp.router.weight"))}


def experts_used(model):
    """Record the experts each MoE block's experts module is called with (`[N, K]`, in layer order)."""
    calls: list[torch.Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args: calls.append(args[1].clone()))
        for n, m in model.named_modules()
        if n.endswith(".experts")
    ]
    return calls, handles
