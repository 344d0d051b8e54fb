"""Tiny MoE GPT models and route batches for the Megatron tests."""

from __future__ import annotations

import torch

VOCAB = 64
EXPERTS = 8
TOPK = 2
HIDDEN = 32


def make_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        init_method_std=0.2,
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(*, vp_stage=None, seq_len=16, **overrides):
    """A GPTModel on the local (no Transformer Engine) spec, allgather dispatcher.

    With ``mtp_num_layers`` in ``overrides`` it also gets multi-token prediction layers.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = make_config(**overrides)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    mtp = None
    if config.mtp_num_layers:  # multi-token prediction layers after the decoder
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=VOCAB,
        max_sequence_length=seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )


def make_batch(
    batch=2,
    seq_len=16,
    layers=2,
    *,
    generator=None,
    dtype=torch.uint8,
    real=(16, 11),
    captured=(15, 9),
    padding="balanced",
):
    """A left-padded microbatch in the collated layout, with random captured routes.

    Sample ``i`` has ``real[i]`` tokens (right-aligned) of which the first
    ``captured[i]`` have routes; every other position holds a padding route.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    routes = torch.empty(batch, seq_len, layers, TOPK, dtype=torch.int64)
    for t in range(seq_len):
        if padding == "balanced":
            routes[:, t] = (torch.arange(TOPK) + t * TOPK) % EXPERTS
        else:
            routes[:, t] = torch.arange(TOPK)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    attention = torch.zeros(batch, seq_len, dtype=torch.long)
    for i in range(batch):
        start = seq_len - real[i]
        attention[i, start:] = 1
        for t in range(start, start + captured[i]):
            for layer in range(layers):
                routes[i, t, layer] = torch.randperm(EXPERTS, generator=g)[:TOPK]
        mask[i, start : start + captured[i]] = False
    return {
        "rollout_expert_indices": routes.to(dtype),
        "router_padding_mask": mask,
        "attention_mask": attention,
        "input_ids": torch.randint(0, VOCAB, (batch, seq_len), generator=g),
    }


def forward_step(data_iterator, model):
    """A plain Megatron forward step: next batch, LM loss over the real tokens."""
    batch = next(data_iterator)
    ids = batch["input_ids"]
    b, s = ids.shape
    positions = torch.arange(s).expand(b, s)
    labels = torch.roll(ids, -1, dims=1)
    output = model(ids, positions, None, labels=labels)

    def loss_func(output_tensor):
        keep = batch["attention_mask"].float()
        loss = (output_tensor.float() * keep).sum()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def run_step(hook, model, batches, *, forward_only=False, step=None, num_microbatches=None, record=False):
    """One ``hook.forward_backward`` over ``batches`` with Megatron's default schedule."""
    return hook.forward_backward(
        record=record,
        forward_step_func=step or forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches) if num_microbatches is None else num_microbatches,
        seq_length=batches[0]["input_ids"].shape[1],
        micro_batch_size=batches[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )


class RouteRecorder:
    """Records, for every call of every router, its replay action and selected experts.

    ``inputs`` keeps each call's router input (hidden states) for references
    computed independently of Megatron's routing code.
    """

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls = {}  # layer (0-based) -> list of (action, [S*B, E] bool routing map)
        self.inputs = {}  # layer (0-based) -> list of [S*B, H] router inputs
        self.routers = {}  # layer (0-based) -> the TopKRouter
        self.handles = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                layer = module.layer_number - 1
                self.calls[layer] = []
                self.inputs[layer] = []
                self.routers[layer] = module
                self.handles.append(module.register_forward_hook(self._record(module, layer)))

    def _record(self, module, layer):
        def hook(mod, args, output):
            action = mod.router_replay.router_replay_action if mod.router_replay else None
            self.calls[layer].append((action, output[1].detach().clone()))
            self.inputs[layer].append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

        return hook

    def clear(self):
        for layer in self.calls:
            self.calls[layer].clear()
            self.inputs[layer].clear()

    def close(self):
        for h in self.handles:
            h.remove()


def expected_map(routes_one_layer, experts=EXPERTS):
    """[B, S, K] routes -> [S*B, E] bool routing map in the router's token order."""
    b, s, k = routes_one_layer.shape
    flat = routes_one_layer.long().transpose(0, 1).reshape(s * b, k)
    return torch.zeros(s * b, experts, dtype=torch.bool).scatter(1, flat, True)


def own_choice(router, hidden):
    """[N, E] bool map of the experts a router picks on its own, by a plain reference.

    Recomputes the router from its weights: logits, the score function, the
    expert bias and group-limited selection, token by token in Python, so it
    shares no routing code with Megatron.
    """
    config = router.config
    logits = hidden.float() @ router.weight.detach().float().t()
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if router.expert_bias is not None:
            scores = scores + router.expert_bias.float()
    else:
        scores = torch.softmax(logits, dim=-1) if config.moe_router_pre_softmax else logits
    k = config.moe_router_topk
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    for row, s in enumerate(scores.tolist()):
        allowed = range(len(s))
        if group_topk:
            size = len(s) // groups
            strength = [
                sum(sorted(s[g * size : (g + 1) * size], reverse=True)[: k // group_topk]) for g in range(groups)
            ]
            best = sorted(range(groups), key=lambda g: -strength[g])[:group_topk]
            allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        for e in sorted(allowed, key=lambda e: -s[e])[:k]:
            chosen[row, e] = True
    return chosen


def build_hybrid_model(pattern="*E*E", *, seq_len=16, **overrides):
    """A HybridModel (megatron-core 0.18+) of attention and MoE layers on local (no TE) modules.

    Megatron's stock hybrid spec uses Transformer Engine; this one takes the same
    pieces from the local GPT layer spec. No Mamba: its kernels need CUDA.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    config = make_config(num_layers=len(pattern.replace("|", "")), **overrides)
    local = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm, self_attention=local.self_attention, self_attn_bda=local.self_attn_bda
    )
    moe = TransformerLayerSubmodules(pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda)
    spec = ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=moe),
        ),
    )
    return HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=seq_len,
        hybrid_layer_pattern=pattern,
        position_embedding_type="learned_absolute",
    )
