"""The Megatron training side of the demo: a tiny MoE `GPTModel` served in bf16 and trained in fp32.

`torch_r3.demo.run(cfg, trainer="megatron")` runs it (the default of
`torch-r3 demo`). On a machine without CUDA, Megatron's few CUDA-only calls are
redirected to the CPU (`torch_r3.megatron._cpu`); with a GPU nothing is redirected.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3.demo.common import DemoConfig, SampledServedModel, StepOutputs, logprob_mismatch, replay_figures
from torch_r3.keys import ATTENTION_MASK, ROUTER_MASK, ROUTES

#: What `torch_r3.demo.run` says while it builds this side's models.
BUILDING = "building the fp32 training model and its bf16 inference copy"


# ---------------------------------------------------------------------------
# Megatron set-up
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def megatron_world():
    """A gloo process group of one and Megatron's parallel state, CPU redirections where needed."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # A world of one needs no rendezvous: an in-process store, so no TCP port is probed and
    # then lost to another process between the probe and the bind (EADDRINUSE on busy machines).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        if torch.cuda.is_available():
            yield
        else:
            # Megatron hard-codes a few CUDA calls; the test suite redirects
            # exactly those to the CPU. A GPU machine needs none of this.
            from torch_r3.megatron._cpu import megatron_on_cpu

            with megatron_on_cpu():
                yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _transformer_config(cfg: DemoConfig, *, bf16: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.topk,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        init_method_std=cfg.init_method_std,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def build_models(cfg: DemoConfig):
    """(fp32 training model, bf16 inference model) with identical weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    def gpt(config):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
        )

    torch.manual_seed(cfg.seed)
    train_model = gpt(_transformer_config(cfg, bf16=False))
    bf16_config = _transformer_config(cfg, bf16=True)
    infer_model = gpt(bf16_config)
    infer_model.load_state_dict(train_model.state_dict())
    # Float16Module casts the weights to bf16 and runs the forward in bf16.
    infer_model = Float16Module(bf16_config, infer_model).eval()
    return train_model, infer_model


def own_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This model's TopKRouters in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(routers, key=lambda r: r.layer_number)


class MegatronServedModel(SampledServedModel):
    """A bf16 Megatron `GPTModel` served by `torch_r3.testing.LoopbackServer`.

    Generation samples one token per forward (no KV cache: the model is tiny);
    a final scoring forward over every evaluated position records the routes
    (Megatron's `RouterReplay` in `RECORD` mode) and the sampled tokens'
    log-probs, as an inference engine returns them.
    """

    def __init__(self, model: torch.nn.Module, cfg: DemoConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.num_layers = cfg.num_layers
        self.num_experts = cfg.num_experts
        self.topk = cfg.topk
        self.replays: list[Any] = [r.router_replay for r in own_routers(model)]  # Megatron's RouterReplay

    @torch.no_grad()
    def forward(self, ids: Sequence[int], *, record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over `ids`, every router choosing its own experts.

        Args:
            ids: Token ids of one sequence.
            record: Also read back the experts each position was routed to.

        Returns:
            `(logits [S, V] in float32, routes [S, L, K] or None)`.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        tokens = torch.tensor([list(ids)], dtype=torch.long)
        positions = torch.arange(tokens.shape[1])[None]
        for r in self.replays:
            if record:
                r.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                r.clear_router_replay_action()
        try:
            logits = self.model(tokens, positions, None)[0].float()  # [S, V]
            routes = None
            if record:  # [S*B, K] per layer, B == 1
                routes = torch.stack([r.get_recorded_indices() for r in self.replays], dim=1)
        finally:
            for r in self.replays:
                r.clear_router_replay_action()
                r.clear_indices()
        return logits, routes


class ForwardStep:
    """Megatron's `forward_step_func` for left-padded batches; keeps each microbatch's log-probs.

    `logp[m]` is `[B, S - 1]`: the log-probability the model gives token `t + 1`
    at position `t`. The loss is the mean negative log-prob over `loss_mask`.
    """

    def __init__(self) -> None:
        self.logp: list[torch.Tensor] = []

    def __call__(self, data_iterator, model):
        """Megatron's signature: `(output, loss_func)` for the next microbatch."""
        batch = next(data_iterator)
        ids = batch["input_ids"]
        att = batch[ATTENTION_MASK]
        S = ids.shape[1]
        # Left padding: positions count from each trajectory's first token, as
        # on the server, and padding keys are masked (True = masked out).
        positions = (att.cumsum(1) - 1).clamp(min=0)
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
        mask = causal[None, None] | (att[:, None, None, :] == 0)
        logits = model(ids, positions, mask)  # [B, S, V]
        return logits, functools.partial(self.loss, batch)

    def loss(self, batch, output):
        """The `loss_func` Megatron calls with the model's output `[B, S, V]`."""
        ids = batch["input_ids"]
        logp = torch.log_softmax(output.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        self.logp.append(logp.detach())
        lm = batch["loss_mask"][:, 1:]
        loss = -(logp * lm).sum() / lm.sum().clamp(min=1)
        return loss, {"loss": loss.detach()}


class RouterSpy:
    """Records every router call's routing map `[S*B, E]` (the experts really used)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self.handles = [r.register_forward_hook(self._hook(k)) for k, r in enumerate(routers)]

    def _hook(self, k: int):
        def hook(module, args, output):
            self.maps[k].append(output[1].detach().clone())

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_schedule(model, microbatches: list[dict[str, torch.Tensor]], cfg: DemoConfig, *, uncaptured: str | None):
    """One forward/backward through Megatron's schedule; `uncaptured=None` runs without `ReplayHook`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from torch_r3.megatron import ReplayHook

    forward_step = ForwardStep()
    spy = RouterSpy(own_routers(model))
    model.zero_grad(set_to_none=True)
    kwargs: dict[str, Any] = dict(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=max(mb["input_ids"].shape[1] for mb in microbatches),
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    stats = None
    try:
        if uncaptured is None:
            get_forward_backward_func()(**kwargs)
        else:
            with ReplayHook(model, uncaptured=uncaptured, expert_load=True) as hook:
                hook.forward_backward(get_forward_backward_func(), **kwargs)
                stats = hook.last_stats
    finally:
        spy.close()
    return StepOutputs(forward_step.logp, spy.maps, stats)


def route_agreement(outputs: StepOutputs, microbatches, cfg: DemoConfig) -> dict[str, Any]:
    """Share of real tokens with a captured route whose training-side experts equal the rollout's."""
    agree = np.zeros(cfg.num_layers)
    total = 0
    for m, mb in enumerate(microbatches):
        routes = mb[ROUTES].long()  # [B, S, L, K]
        B, S = routes.shape[:2]
        captured = ~mb[ROUTER_MASK]  # [B, S]
        total += int(captured.sum())
        for layer in range(cfg.num_layers):
            used = outputs.routing_maps[layer][m].view(S, B, -1).transpose(0, 1)  # [B, S, E]
            want = torch.zeros_like(used).scatter(-1, routes[:, :, layer], True)
            agree[layer] += int(((used == want).all(-1) & captured).sum())
    return {
        "route_agreement": float(agree.sum() / (total * cfg.num_layers)),
        "route_agreement_per_layer": [float(a / total) for a in agree],
        "tokens": total,
    }


def measure(model, microbatches, cfg: DemoConfig, *, uncaptured: str | None) -> dict[str, Any]:
    """One training run and both measurements, plus `hook.last_stats` where replay ran."""
    outputs = run_schedule(model, microbatches, cfg, uncaptured=uncaptured)
    figures = {**route_agreement(outputs, microbatches, cfg), **logprob_mismatch(outputs, microbatches)}
    return {**figures, **replay_figures(outputs.stats)}


#: The context the models are built and trained in: a Megatron world of one process.
world = megatron_world
#: The inference side's `ServedModel` around the bf16 copy.
served_model = MegatronServedModel
