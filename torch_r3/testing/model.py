"""What the loopback server serves: a small model protocol and a tiny MoE LM.

`ServedModel` is the one thing the server asks of a model, so any MoE model
(the tiny pure-PyTorch one below, or a Megatron `GPTModel` behind an adapter)
can sit behind the same endpoints.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_int, check_positive

__all__ = ["GenerateOutput", "ServedModel", "TinyMoELM"]


@dataclass(frozen=True, eq=False)
class GenerateOutput:
    """One generation, as a `ServedModel` returns it.

    Attributes:
        token_ids: The generated token ids.
        logprobs: The log-probability of each generated token under the
            sampling distribution, one per token.
        routes: `[len(prompt) + len(token_ids) - 1, num_layers, topk]` integer
            array over every hidden layer: the experts every evaluated position
            was routed to, from position 0 (the last generated token is never
            run forward). Rows of dense layers are zero.
        finish_reason: `"stop"` (a stop token was sampled) or `"length"`.
    """

    token_ids: list[int]
    logprobs: list[float]
    routes: np.ndarray
    finish_reason: str


class ServedModel(abc.ABC):
    """The model behind the loopback server.

    Implementations set `num_layers` (every hidden layer, dense ones
    included), `num_experts` and `topk`, and implement `generate`. A model
    with dense layers overrides `moe_layer_pattern`; one that can change its
    weights overrides `update_weights`. The server slices the routes to the
    requested start and encodes them itself. Calls come from the server's
    thread, one request at a time; implementations need not be re-entrant.
    """

    num_layers: int
    num_experts: int
    topk: int

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """One entry per hidden layer: `True` for a MoE layer (all layers by default)."""
        return (True,) * self.num_layers

    def update_weights(self, step: int) -> None:
        """Replace the weights with those of weight update number `step` (1, 2, ...).

        The default raises `NotImplementedError`: a model that cannot change its
        weights cannot be served across `LoopbackServer.update_weights`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement update_weights")

    @abc.abstractmethod
    def generate(self, token_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> GenerateOutput:
        """Generate a continuation of `token_ids`.

        Args:
            token_ids: The prompt, at least one token.
            sampling_params: Request options; implementations raise
                `ValueError`/`TypeError` for ones they do not support, which
                the server answers with `400`.

        Returns:
            The generated tokens, their logprobs and the routes of every
            evaluated position (see `GenerateOutput`).
        """


class TinyMoELM(ServedModel):
    """A tiny decoder-only MoE language model in pure PyTorch, seeded random weights.

    Each layer is pre-norm causal single-head attention followed by an MLP: a
    mixture-of-experts MLP with a softmax top-k router, or, for the first
    `first_k_dense` layers, a plain dense MLP (as DeepSeek-style models do).
    The routers' top-k indices at every position are the routes; dense layers
    have no router and their route rows are zero, as real servers return them.
    Computation is in float64, so a position's routes do not depend on how
    long the evaluated sequence is (near-ties that could flip between a prefix
    and a whole-sequence forward are vanishingly unlikely); a multi-turn
    rollout therefore sees the same routes as one request over the whole
    conversation.

    Supported `sampling_params`: `max_new_tokens` (or `max_tokens`; default 8,
    at least 1), `temperature` (`0` or absent: greedy), `seed` (for sampling;
    default 0), `stop_token_ids`, `ignore_eos`, and
    `routed_experts_prompt_start` (read by the server).

    Args:
        vocab_size: Vocabulary size; token ids are `0 .. vocab_size - 1`.
        hidden_size: Model width.
        num_layers: Transformer layers (hidden layers), dense ones included.
        num_experts: Experts per MoE layer.
        topk: Experts each token is routed to.
        seed: Seed of the random weights.
        eos_token_id: Token that ends generation (`None`: none).
        first_k_dense: How many leading layers are dense (no router).

    Examples:
        >>> model = TinyMoELM(seed=0)
        >>> out = model.generate([1, 2, 3], {"max_new_tokens": 4})
        >>> len(out.token_ids), out.routes.shape
        (4, (6, 2, 2))
        >>> dense_first = TinyMoELM(num_layers=3, first_k_dense=1)
        >>> dense_first.moe_layer_pattern
        (False, True, True)
        >>> int(dense_first.generate([1, 2], {"max_new_tokens": 2}).routes[:, 0].max())
        0
    """

    _SAMPLING_KEYS = frozenset(
        {
            "max_new_tokens",
            "max_tokens",
            "temperature",
            "seed",
            "stop_token_ids",
            "ignore_eos",
            "routed_experts_prompt_start",
        }
    )

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_experts: int = 8,
        topk: int = 2,
        seed: int = 0,
        eos_token_id: int | None = None,
        first_k_dense: int = 0,
    ) -> None:
        self.vocab_size = check_positive(vocab_size, "vocab_size")
        self.hidden_size = check_positive(hidden_size, "hidden_size")
        self.num_layers = check_positive(num_layers, "num_layers")
        self.num_experts = check_positive(num_experts, "num_experts")
        self.topk = check_positive(topk, "topk")
        if self.topk > self.num_experts:
            raise ValueError(f"topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        self.first_k_dense = check_int(first_k_dense, "first_k_dense")
        if not 0 <= self.first_k_dense < self.num_layers:
            raise ValueError(f"first_k_dense must be in [0, num_layers={self.num_layers}), got {self.first_k_dense}")
        self.seed = check_int(seed, "seed")
        self.eos_token_id = None if eos_token_id is None else check_int(eos_token_id, "eos_token_id")
        self._lock = threading.Lock()
        self._init_weights(self.seed)

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """`False` for the first `first_k_dense` layers, `True` for the rest."""
        return tuple(i >= self.first_k_dense for i in range(self.num_layers))

    def update_weights(self, step: int) -> None:
        """Redraw every weight from a seed derived from `seed` and `step`, so routes change.

        Examples:
            >>> model = TinyMoELM()
            >>> before = model.generate([1, 2, 3], {"max_new_tokens": 4}).routes
            >>> model.update_weights(1)
            >>> bool((model.generate([1, 2, 3], {"max_new_tokens": 4}).routes != before).any())
            True
        """
        step = check_positive(step, "step")
        with self._lock:
            self._init_weights(self.seed + 1_000_003 * step)

    def _init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        h, f, e = self.hidden_size, 2 * self.hidden_size, self.num_experts

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)

        self.embed = w(self.vocab_size, h, fan_in=1)
        self.layers = []
        for moe in self.moe_layer_pattern:
            layer = {"qkv": w(h, 3 * h, fan_in=h), "proj": w(h, h, fan_in=h)}
            if moe:
                layer.update(router=w(h, e, fan_in=h), up=w(e, h, f, fan_in=h), down=w(e, f, h, fan_in=f))
            else:
                layer.update(up=w(h, f, fan_in=h), down=w(f, h, fan_in=f))
            self.layers.append(layer)
        self.unembed = w(h, self.vocab_size, fan_in=h)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model over `token_ids`.

        Returns:
            `(logits [n, vocab_size], routes [n, num_layers, topk] int64)`;
            the route rows of dense layers are zero.
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        n, h = ids.numel(), self.hidden_size
        x = self.embed[ids]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        # Zero-initialised like a server's capture buffer: dense layers stay zero.
        routes = torch.zeros(n, self.num_layers, self.topk, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            q, k, v = (_rms(x) @ layer["qkv"]).split(h, dim=-1)
            scores = (q @ k.T / math.sqrt(h)).masked_fill(~causal, float("-inf"))
            x = x + (scores.softmax(-1) @ v) @ layer["proj"]
            hn = _rms(x)
            if "router" not in layer:
                x = x + torch.relu(hn @ layer["up"]) @ layer["down"]
                continue
            probs = (hn @ layer["router"]).softmax(-1)
            weights, experts = probs.topk(self.topk, dim=-1)
            routes[:, i] = experts
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                token, slot = (experts == e).nonzero(as_tuple=True)
                if token.numel():
                    y = torch.relu(hn[token] @ layer["up"][e]) @ layer["down"][e]
                    out.index_add_(0, token, y * weights[token, slot, None])
            x = x + out
        return _rms(x) @ self.unembed, routes

    def generate(self, token_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> GenerateOutput:
        """Generate with full recompute per step (tiny model, short sequences).

        See the class docstring for the supported `sampling_params`.
        """
        params = self._check_params(token_ids, sampling_params)
        max_new, temperature, stop = params
        gen = torch.Generator().manual_seed(int(sampling_params.get("seed", 0)))
        ids = list(token_ids)
        new_ids: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        with self._lock:
            for _ in range(max_new):
                # The last forward runs over prompt + generated[:-1]: exactly the
                # positions the routes must cover.
                logits, routes = self.forward(ids)
                last = logits[-1]
                if temperature == 0.0:
                    logp = last.log_softmax(-1)
                    token = int(last.argmax())
                else:
                    logp = (last / temperature).log_softmax(-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                new_ids.append(token)
                logprobs.append(float(logp[token]))
                ids.append(token)
                if token in stop:
                    finish = "stop"
                    break
        return GenerateOutput(token_ids=new_ids, logprobs=logprobs, routes=routes.numpy(), finish_reason=finish)

    def _check_params(self, token_ids: Sequence[int], params: Mapping[str, Any]) -> tuple[int, float, set[int]]:
        if not isinstance(params, Mapping):
            raise TypeError(f"sampling_params must be an object, got {type(params).__name__}")
        unknown = sorted(set(params) - self._SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unsupported sampling_params {unknown}; supported: {sorted(self._SAMPLING_KEYS)}")
        if len(token_ids) == 0:
            raise ValueError("token_ids must hold at least one token")
        for i, t in enumerate(token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token_ids[{i}] must be an int in [0, {self.vocab_size}), got {t!r}")
        max_new = params.get("max_new_tokens", params.get("max_tokens", 8))
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}")
        temperature = params.get("temperature", 0.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        seed = params.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        stop = params.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            raise ValueError(f"stop_token_ids must be a list of ints, got {stop!r}")
        stop_set = set(stop)
        if self.eos_token_id is not None and not params.get("ignore_eos", False):
            stop_set.add(self.eos_token_id)
        return max_new, float(temperature), stop_set


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
