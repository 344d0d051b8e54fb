"""Per-family weight rules: the weights a `transformers` router gives a choice of experts.

Every supported router's `forward(hidden_states)` returns
`(router_logits, routing_weights, selected_experts)`. Replay keeps the logits
(they carry the gradient into the router's weight), swaps the selection for the
replayed one and recomputes the weights of that selection from the logits,
exactly as the family's own forward weights its own selection, so that
replaying the router's own choice reproduces its output bit for bit.

What the families of `transformers` 5.x do with their choice:

* `softmax_then_pick` (Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3.5-MoE, Mixtral):
  softmax over all experts in float32, the chosen probabilities, renormalised
  to sum to one where the router says so (`norm_topk_prob`; Mixtral and
  Qwen3.5-MoE always), cast back to the logits' dtype (not Mixtral).
* `pick_then_softmax` (gpt-oss): softmax over the chosen logits only (the
  logits include the router's bias).
* `sigmoid_grouped` (DeepSeek-V3, DeepSeek-V3.2, GLM-4.5 MoE, `glm4_moe_lite` and `glm_moe_dsa`): sigmoid scores of the chosen
  experts (the selection-only `e_score_correction_bias` and the group limit
  decide which experts are chosen, never their weight), renormalised where
  `norm_topk_prob` is set, times `routed_scaling_factor`.

A family is recognised by the router's class (its module and name, looked up
along the class's MRO, so FSDP2's generated subclasses match too); nothing is
imported from `transformers` here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# `family_of` is the hook's internal lookup, shared with `hook.py` under a plain name.
__all__ = ["FAMILIES", "Family", "supported_families"]

WeightRule = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _attr(router: torch.nn.Module) -> Any:
    # The routers' plain attributes (top_k, norm_topk_prob, ...), which nn.Module's typing cannot see.
    return router


def _softmax_then_pick(*, always_normalize: bool, cast: bool) -> WeightRule:
    def weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, experts)
        if always_normalize or _attr(router).norm_topk_prob:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return chosen.to(logits.dtype) if cast else chosen

    return weights


def _pick_then_softmax(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    chosen = logits.gather(1, experts)
    return torch.softmax(chosen, dim=1, dtype=chosen.dtype)


def _sigmoid_grouped(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    chosen = logits.sigmoid().gather(1, experts)
    if _attr(router).norm_topk_prob:
        # The same epsilon as the family's forward, so an all-but-zero choice weighs the same.
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * float(_attr(router).routed_scaling_factor)


@dataclass(frozen=True)
class Family:
    """One model family's router class and the rule that weights a choice of its experts.

    Attributes:
        name: The `transformers` model type, e.g. `"qwen3_moe"`.
        module: The module that defines the router class.
        router: The router class's name.
        weights: `weights(router, logits [N, E], experts [N, K] int64) -> [N, K]`.
    """

    name: str
    module: str
    router: str
    weights: WeightRule


def _family(name: str, router: str, weights: WeightRule) -> Family:
    return Family(name, f"transformers.models.{name}.modeling_{name}", router, weights)


FAMILIES: tuple[Family, ...] = (
    _family("qwen3_moe", "Qwen3MoeTopKRouter", _softmax_then_pick(always_normalize=False, cast=True)),
    _family("qwen2_moe", "Qwen2MoeTopKRouter", _softmax_then_pick(always_normalize=False, cast=True)),
    _family("olmoe", "OlmoeTopKRouter", _softmax_then_pick(always_normalize=False, cast=True)),
    _family("qwen3_5_moe", "Qwen3_5MoeTopKRouter", _softmax_then_pick(always_normalize=True, cast=True)),
    _family("mixtral", "MixtralTopKRouter", _softmax_then_pick(always_normalize=True, cast=False)),
    _family("gpt_oss", "GptOssTopKRouter", _pick_then_softmax),
    _family("deepseek_v3", "DeepseekV3TopkRouter", _sigmoid_grouped),
    _family("glm4_moe", "Glm4MoeTopkRouter", _sigmoid_grouped),
    _family("glm4_moe_lite", "Glm4MoeLiteTopkRouter", _sigmoid_grouped),
    _family("deepseek_v32", "DeepseekV32TopkRouter", _sigmoid_grouped),
    _family("glm_moe_dsa", "GlmMoeDsaTopkRouter", _sigmoid_grouped),
)
"""The supported families, one router class each (checked against `transformers` 5.24)."""

_BY_CLASS = {(f.module, f.router): f for f in FAMILIES}


def family_of(module: torch.nn.Module) -> Family | None:
    """The `Family` whose router class `module` is (or derives from); `None` for any other module.

    Examples:
        >>> family_of(torch.nn.Linear(2, 2)) is None
        True
    """
    for cls in type(module).__mro__:
        found = _BY_CLASS.get((cls.__module__, cls.__name__))
        if found is not None:
            return found
    return None


def supported_families() -> str:
    """The supported families and their router classes, for error messages.

    Examples:
        >>> supported_families().split(", ")[0]
        'qwen3_moe (Qwen3MoeTopKRouter)'
    """
    return ", ".join(f"{f.name} ({f.router})" for f in FAMILIES)
