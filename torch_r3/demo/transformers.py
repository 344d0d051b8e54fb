"""The demo's Hugging Face side (`torch-r3 demo --trainer transformers`): one RL step with R3 on a transformers model.

The same step as the Megatron demo (`torch_r3.demo`), with a tiny random
`transformers` Qwen3-MoE model in place of Megatron's `GPTModel`:

1. The loopback server serves the model in **bfloat16**; `ReplayHook.record()`
   reads back the experts its routers chose at every evaluated position, as an
   inference engine captures them.
2. The same multi-turn rollouts through `RemoteGenerateClient` and
   `RoutedExpertTrace`, and the same `DataLoader` with `R3Collator`.
3. The **same weights in float32** train one step three times: with
   `ReplayHook` (uncaptured tokens live), with `uncaptured="replay"`, and
   without replay, each microbatch in `with hook.replay(batch):`.
4. The same report: route agreement on captured tokens, the log-prob gap and
   k3 KL against the rollout, and `hook.last_stats`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from torch_r3.demo.common import (
    DemoConfig,
    SampledServedModel,
    StepOutputs,
    logprob_mismatch,
    replay_figures,
)
from torch_r3.keys import ATTENTION_MASK, ROUTER_MASK, ROUTES
from torch_r3.transformers.hook import ReplayHook

__all__ = ["TransformersServedModel", "build_models", "measure"]


def build_models(cfg: DemoConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fp32 training model, bf16 inference model): a tiny random Qwen3-MoE, identical weights."""
    import transformers

    settings: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": 2 * cfg.hidden_size,
        "moe_intermediate_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.topk,
        "norm_topk_prob": True,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_method_std,
        "pad_token_id": 0,
        "eos_token_id": cfg.eos_token_id,
        "bos_token_id": None,
    }
    config = transformers.Qwen3MoeConfig(**settings)
    config._attn_implementation = "eager"  # the same kernel in both dtypes, on any machine
    torch.manual_seed(cfg.seed)
    train_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    infer_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    infer_model.load_state_dict(train_model.state_dict())
    return train_model.train(), infer_model.eval()


class TransformersServedModel(SampledServedModel):
    """A bf16 `transformers` MoE model behind `torch_r3.testing.LoopbackServer`; routes via `ReplayHook.record()`."""

    def __init__(self, model: torch.nn.Module, cfg: DemoConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.hook = ReplayHook(model)
        self.num_layers = self.hook.num_layers
        self.num_experts = self.hook.num_experts
        self.topk = self.hook.topk

    @torch.no_grad()
    def forward(self, ids: Sequence[int], *, record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over `ids`, the routers choosing their own experts; `(logits [S, V] fp32, routes [S, L, K])`."""
        tokens = torch.tensor([list(ids)], dtype=torch.long)
        if not record:
            return self.model(input_ids=tokens, use_cache=False).logits[0].float(), None
        with self.hook.record() as rec:
            logits = self.model(input_ids=tokens, use_cache=False).logits[0].float()
        return logits, rec.batch[ROUTES][0]


class _ExpertSpy:
    """The experts every MoE block really used, per layer and microbatch (`[B * T, K]`, batch-major)."""

    def __init__(self, model: torch.nn.Module) -> None:
        blocks = [m for name, m in model.named_modules() if name.endswith(".mlp.experts")]
        self.used: list[list[torch.Tensor]] = [[] for _ in blocks]
        self.handles = [b.register_forward_pre_hook(self._hook(i)) for i, b in enumerate(blocks)]

    def _hook(self, i: int):
        def hook(module, args):
            self.used[i].append(args[1].detach().clone())

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def train_step(model: torch.nn.Module, microbatches, *, uncaptured: str | None):
    """One forward/backward per microbatch (left-padded); `uncaptured=None` runs without `ReplayHook`."""
    model.zero_grad(set_to_none=True)
    spy = _ExpertSpy(model)
    hook = ReplayHook(model, uncaptured=uncaptured, expert_load=True) if uncaptured is not None else None
    logps = []
    try:
        with hook.step() if hook is not None else contextlib.nullcontext():
            for mb in microbatches:
                att = mb[ATTENTION_MASK]
                # Positions count from each trajectory's first token, as on the server.
                positions = (att.cumsum(1) - 1).clamp(min=0)
                with hook.replay(mb) if hook is not None else contextlib.nullcontext():
                    logits = model(input_ids=mb["input_ids"], attention_mask=att, position_ids=positions).logits
                ids = mb["input_ids"]
                logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
                lm = mb["loss_mask"][:, 1:]
                (-(logp * lm).sum() / lm.sum().clamp(min=1)).backward()
                logps.append(logp.detach())
    finally:
        spy.close()
        if hook is not None:
            hook.close()
    return StepOutputs(logps, spy.used, hook.last_stats if hook is not None else None)


def route_agreement(outputs: StepOutputs, microbatches, num_layers: int) -> dict[str, Any]:
    """Share of real tokens with a captured route whose training-side experts are the rollout's (as sets)."""
    agree = [0] * num_layers
    total = 0
    for m, mb in enumerate(microbatches):
        routes = mb[ROUTES].long()  # [B, T, L, K]
        B, T = routes.shape[:2]
        captured = ~mb[ROUTER_MASK]
        total += int(captured.sum())
        for layer in range(num_layers):
            used = outputs.routing_maps[layer][m].view(B, T, -1).sort(-1).values
            same = (used == routes[:, :, layer].sort(-1).values).all(-1)
            agree[layer] += int((same & captured).sum())
    return {
        "route_agreement": sum(agree) / (total * num_layers),
        "route_agreement_per_layer": [a / total for a in agree],
        "tokens": total,
    }


def measure(model, microbatches, cfg: DemoConfig, *, uncaptured: str | None) -> dict[str, Any]:
    """One training run's figures, in the Megatron demo's shape."""
    outputs = train_step(model, microbatches, uncaptured=uncaptured)
    figures = {**route_agreement(outputs, microbatches, cfg.num_layers), **logprob_mismatch(outputs, microbatches)}
    return {**figures, **replay_figures(outputs.stats)}


#: What `torch_r3.demo.run` says while it builds this side's models.
BUILDING = "building the fp32 transformers Qwen3-MoE model and its bf16 inference copy"
#: No process group to set up: the models are built and trained as they are.
world = contextlib.nullcontext
#: The inference side's `ServedModel` around the bf16 copy.
served_model = TransformersServedModel
