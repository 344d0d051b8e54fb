"""Realistic indexer selections from real DSA lightning indexers, for the loopback server, tests and benchmarks.

`IndexerLM` runs `transformers`' own `DeepseekV32Indexer` modules (random
weights, pure PyTorch, so it runs on a CPU) over a token sequence the way an
engine prefills it: in chunks of queries against a growing cache of indexer
keys, so that a 32k-token sequence needs memory for one chunk's scores, not
for all `S x S` of them. Each layer's hidden states are the previous layer's
plus a fixed random residual map of them, so repeated text gives repeated
keys and the selections have the structure text gives them.

`select(tokens)` returns what SGLang's `meta_info.indexer_topk` carries:
`[len(tokens), num_layers, index_topk]` `int32`, row `j` the query at
position `j` (a caller that serves a generation drops the last row), rows that
see `j + 1 <= index_topk` positions written `0 .. j` then `-1`, longer rows
in the indexer's own top-k order, and layers listed in `shared` copied from
the layer before them (DSA's `index_topk_freq`), as SGLang mirrors them.

Needs `transformers` (5.x with `deepseek_v32`); imported when first used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_positive

__all__ = ["IndexerLM"]


class _IndexerKeys:
    """The slice of a `transformers` cache the indexer uses: `update_indexer` appends and returns all keys."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        prev = self.keys.get(layer_idx)
        self.keys[layer_idx] = keys if prev is None else torch.cat([prev, keys], dim=1)
        return self.keys[layer_idx]


class IndexerLM:
    """Real DSA indexers over a token embedding: realistic `indexer_topk` captures (see the module docstring).

    Args:
        num_layers: Indexer layers (SGLang's `num_indexer_layers`).
        index_topk: Positions each query selects (DeepSeek-V3.2: 2048).
        vocab_size: Token ids accepted: `[0, vocab_size)`.
        hidden_size: Width of the embedding and of each layer's hidden states.
        index_n_heads: Indexer heads (DeepSeek-V3.2: 64).
        index_head_dim: Indexer head width (DeepSeek-V3.2: 128).
        shared: Layers that reuse the layer before them's top-k.
        chunk: Queries prefilled per step.
        seed: Seed of the random weights.

    Examples:
        >>> lm = IndexerLM(num_layers=2, index_topk=4, shared=(1,))
        >>> sel = lm.select([5, 6, 7, 5, 6, 7])
        >>> sel.shape, sel[2, 0].tolist(), bool((sel[:, 0] == sel[:, 1]).all())
        ((6, 2, 4), [0, 1, 2, -1], True)
    """

    def __init__(
        self,
        *,
        num_layers: int = 2,
        index_topk: int = 2048,
        vocab_size: int = 256,
        hidden_size: int = 64,
        index_n_heads: int = 4,
        index_head_dim: int = 32,
        shared: Sequence[int] = (),
        chunk: int = 1024,
        seed: int = 0,
    ) -> None:
        from transformers import DeepseekV32Config
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32Indexer,
            DeepseekV32RotaryEmbedding,
        )

        self.num_layers = check_positive(num_layers, "num_layers")
        self.index_topk = check_positive(index_topk, "index_topk")
        self.vocab_size = check_positive(vocab_size, "vocab_size")
        self.chunk = check_positive(chunk, "chunk")
        self.shared = tuple(sorted(set(shared)))
        if any(not 1 <= s < num_layers for s in self.shared):
            raise ValueError(f"shared: layers must be in [1, {num_layers}), got {list(shared)}")
        config = DeepseekV32Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=index_n_heads,
            num_key_value_heads=index_n_heads,
            q_lora_rank=hidden_size,
            qk_rope_head_dim=min(16, index_head_dim),
            index_topk=index_topk,
            index_n_heads=index_n_heads,
            index_head_dim=index_head_dim,
            max_position_embeddings=1 << 20,
        )
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self._indexers = [DeepseekV32Indexer(config, i).eval() for i in range(num_layers)]
            self._rotary = DeepseekV32RotaryEmbedding(config)
        self._embed = torch.randn(vocab_size, hidden_size, generator=gen)
        self._mix = [torch.randn(hidden_size, hidden_size, generator=gen) / hidden_size**0.5 for _ in range(num_layers)]
        self._q = [torch.randn(hidden_size, hidden_size, generator=gen) / hidden_size**0.5 for _ in range(num_layers)]

    def select(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The selections of every position of `tokens`: `[len(tokens), num_layers, index_topk]` `int32`."""
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        if ids.ndim != 1 or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size)):
            raise ValueError(f"tokens: expected a 1-D sequence of ids in [0, {self.vocab_size})")
        n, K = int(ids.numel()), self.index_topk
        out = np.full((n, self.num_layers, K), -1, dtype=np.int32)
        cache = _IndexerKeys()
        with torch.no_grad():
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                self._prefill(ids[lo:hi], lo, cache, out[lo:hi])
        for layer in self.shared:
            out[:, layer] = out[:, layer - 1]
        return out

    def _prefill(self, ids: torch.Tensor, start: int, cache: _IndexerKeys, out: np.ndarray) -> None:
        m, K = ids.numel(), self.index_topk
        pos = torch.arange(start, start + m).unsqueeze(0)
        h = self._embed[ids].unsqueeze(0)
        cos_sin = self._rotary(h, pos)
        keys = torch.arange(start + m)
        mask = torch.where(keys[None, :] <= pos[0][:, None], 0.0, float("-inf")).unsqueeze(0)
        for layer, indexer in enumerate(self._indexers):
            if layer > 0:
                h = h + torch.tanh(h @ self._mix[layer])
            if layer in self.shared:
                continue  # its capture is the layer before it's, copied in select()
            q = torch.nn.functional.rms_norm(h @ self._q[layer], (h.shape[-1],))
            top = indexer(h, q, cos_sin, mask, pos, cache=_LayerCache(cache, layer)).numpy()[0]
            p = start + np.arange(m)
            long = p + 1 > K  # these see more than K positions: all K picks are causal (finite scores)
            if long.any():
                out[long, layer] = top[long]
            if not long.all():
                grid = np.arange(K)
                short = p[~long][:, None]
                out[~long, layer] = np.where(grid[None, :] <= short, grid[None, :], -1)


class _LayerCache:
    """Bind `_IndexerKeys` to the layer id the indexer passes (its own `layer_idx`)."""

    def __init__(self, keys: _IndexerKeys, layer: int) -> None:
        self._keys, self._layer = keys, layer

    def update_indexer(self, k: torch.Tensor, layer_idx: Any) -> torch.Tensor:
        return self._keys.update_indexer(k, self._layer)
