"""A tiny Megatron-core 0.19 GPT with DeepSeek Sparse Attention on the local (no Transformer Engine) spec.

Megatron's DSA spec asks its backend for `linear()` with
`parallel_mode="duplicated"` (Transformer Engine's `TELinear`), which the local
backend lacks; `DuplicatedLinear` is Megatron's `ColumnParallelLinear` taking
that argument (with one tensor-parallel rank, column-parallel is duplicated).
The MLA down-projections get `ColumnParallelLinear` itself (the absorbed MLA
accepts it by identity). The indexer's Hadamard rotation needs
`fast_hadamard_transform` (CUDA) and bf16, so it is off here.
"""

from __future__ import annotations

import torch

VOCAB = 64
TOPK = 3


def dsa_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kwargs = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        init_method_std=0.2,
        pipeline_dtype=torch.float32,
        multi_latent_attention=True,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=8,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=16,
        dsa_indexer_topk=TOPK,
        dsa_indexer_topk_freq=2,
        dsa_indexer_rotate_activation=False,
        rope_type="rope",
        normalization="RMSNorm",
        attention_backend="unfused",
    )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def build_dsa_model(seq_len=16, **overrides):
    """A `GPTModel` whose every layer is absorbed MLA with `DSAttention` (layer 2 shares layer 1's top-k)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    class DuplicatedLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, parallel_mode=None, **kwargs):
            super().__init__(input_size, output_size, gather_output=False, **kwargs)

    class Backend(LocalSpecProvider):
        def linear(self):
            return DuplicatedLinear

    config = dsa_config(**overrides)
    backend = Backend()
    specs = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    for spec in specs:
        attention = spec.submodules.self_attention.submodules
        attention.linear_q_down_proj = ColumnParallelLinear
        attention.linear_kv_down_proj = ColumnParallelLinear
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=backend.layer_norm(rms_norm=True))
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
    )


def random_selections(real, seq_len, layers, *, generator, topk=TOPK):
    """A left-padded `[B, T, L, K]` batch of valid random selections and its `[B, T]` mask.

    Sample `i`'s `real[i]` tokens sit at the right; all but its last token have a
    selection (the last token is uncaptured, as SGLang sends `seqlen - 1` rows).
    Each captured query at `t` selects `min(topk, t - first + 1)` distinct
    positions of `[first, t]`, sorted, `-1` after.
    """
    B = len(real)
    sel = torch.full((B, seq_len, layers, topk), -1, dtype=torch.int16)
    mask = torch.ones(B, seq_len, dtype=torch.bool)
    for b, n in enumerate(real):
        first = seq_len - n
        for t in range(first, seq_len - 1):
            mask[b, t] = False
            seen = t - first + 1
            for layer in range(layers):
                pick = torch.randperm(seen, generator=generator)[: min(topk, seen)] + first
                sel[b, t, layer, : pick.numel()] = pick.sort().values.to(torch.int16)
    return sel, mask
