"""The loopback server's engine: a served model behind a prefix cache that keeps routes.

Real servers capture routes into a buffer laid out like their KV cache, so a
request whose prefix is already cached gets, for those positions, the routes
recorded when the cached blocks were computed, not routes of the model as it
is now. After a weight update that makes them stale, unless the cache was
flushed or the request carried a salt that keys the cache apart. `PrefixCache`
reproduces exactly that: blocks of `block_size` tokens, keyed by the salt and
the whole token prefix up to the block's end, each holding its routes.
`Engine` runs a `ServedModel` through it and keeps the weight version.

Nothing here knows about HTTP; the protocol modules in `torch_r3.testing._wire`
parse requests into a `GenerateRequest` and render a `Generation`.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torch_r3._checks import check_positive, check_str
from torch_r3.testing.model import ServedModel

__all__ = ["Engine", "GenerateRequest", "Generation", "ModelOutputError", "PrefixCache"]


class ModelOutputError(ValueError):
    """The served model broke its contract (the server answers `500`, not `400`)."""


@dataclass(frozen=True)
class GenerateRequest:
    """One generate call, parsed from any protocol.

    Attributes:
        prompt: The prompt token ids.
        sampling_params: The options handed to the model's `generate`.
        return_routes: Whether the response carries routes.
        start: First route row to return (`0` = the whole prompt).
        salt: Cache salt; requests share cached blocks only with an equal salt
            (`None` is a salt of its own).
        options: Protocol-specific details the renderer needs (logprob counts,
            whether token ids are echoed, ...).
    """

    prompt: list[int]
    sampling_params: dict[str, Any]
    return_routes: bool = False
    start: int = 0
    salt: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Generation:
    """What the engine produced for one request.

    Attributes:
        token_ids: Generated token ids.
        logprobs: One log-probability per generated token.
        routes: `[len(prompt) + len(token_ids) - 1, num_layers, topk]` routes from
            position 0, cached rows included (`None` for an aborted request).
        finish_reason: `"stop"`, `"length"` or `"abort"`.
        cached_tokens: Leading prompt positions served from the prefix cache.
        weight_version: The engine's weight version when the request ran.
    """

    token_ids: list[int]
    logprobs: list[float]
    routes: np.ndarray | None
    finish_reason: str
    cached_tokens: int
    weight_version: str


class PrefixCache:
    """Block-granular prefix cache storing each block's routes, LRU-bounded.

    A block of positions `[i * block_size, (i + 1) * block_size)` is keyed by a
    digest of the salt and `tokens[:(i + 1) * block_size]`: two requests share
    it only when the salt and every token up to the block's end agree. Only full blocks are
    stored, and a cached block is never overwritten, so its routes stay those
    of the request that computed it.

    Args:
        block_size: Tokens per block (`1` behaves like a token-granular radix tree).
        max_blocks: Blocks kept; the least recently used go first.

    Examples:
        >>> import numpy as np
        >>> cache = PrefixCache(block_size=2, max_blocks=8)
        >>> cache.store("s", [5, 6, 7, 8, 9], np.arange(4).reshape(4, 1, 1))
        >>> hit, rows = cache.match("s", [5, 6, 7, 8, 1])
        >>> hit, rows.ravel().tolist()
        (4, [0, 1, 2, 3])
        >>> cache.match("s", [5, 6, 7])[0], cache.match(None, [5, 6, 7, 8, 9])[0]
        (2, 0)
    """

    def __init__(self, block_size: int = 16, max_blocks: int = 4096) -> None:
        self.block_size = check_positive(block_size, "block_size")
        self.max_blocks = check_positive(max_blocks, "max_blocks")
        self._blocks: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, salt: str | None, prompt: list[int]) -> tuple[int, np.ndarray | None]:
        """The longest cached prefix of `prompt` that leaves its last token to compute.

        Returns:
            `(hit, routes)`: `hit` positions (a multiple of `block_size`, at most
            `len(prompt) - 1`) and their cached routes `[hit, L, K]` (`None` when
            `hit == 0`).
        """
        blocks = []
        for key in self._keys(salt, prompt, (len(prompt) - 1) // self.block_size):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            blocks.append(block)
        if not blocks:
            return 0, None
        return len(blocks) * self.block_size, np.concatenate(blocks)

    def store(self, salt: str | None, tokens: list[int], routes: np.ndarray) -> None:
        """Cache every full block of the evaluated positions not cached yet.

        Args:
            salt: The request's salt.
            tokens: The sequence the routes belong to (prompt and generated ids).
            routes: `[evaluated, L, K]` routes of `tokens[:evaluated]`.
        """
        bs = self.block_size
        for i, key in enumerate(self._keys(salt, tokens, routes.shape[0] // bs)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = routes[i * bs : (i + 1) * bs].copy()
            if len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def _keys(self, salt: str | None, tokens: list[int], n_blocks: int) -> Iterator[bytes]:
        # A chain of digests, as vLLM hashes its blocks: block i's key covers the
        # salt and every token up to its end, at a cost linear in the tokens.
        digest = hashlib.sha256(repr(salt).encode()).digest()
        bs = self.block_size
        for i in range(n_blocks):
            block = np.asarray(tokens[i * bs : (i + 1) * bs], dtype="<i8")
            digest = hashlib.sha256(digest + block.tobytes()).digest()
            yield digest

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()


class Engine:
    """A `ServedModel` behind an optional `PrefixCache`, with a weight version.

    Thread-safe: generation, weight updates and flushes are serialised.

    Args:
        model: The model to generate with.
        cache: The prefix cache (`None`: no caching; every route is fresh).
        weight_version: The initial weight version.

    Examples:
        >>> from torch_r3.testing.model import TinyMoELM
        >>> engine = Engine(TinyMoELM(), PrefixCache(block_size=2))
        >>> first = engine.generate(GenerateRequest([1, 2, 3, 4, 5], {"max_new_tokens": 2}))
        >>> engine.update_weights()
        '1'
        >>> again = engine.generate(GenerateRequest([1, 2, 3, 4, 5], {"max_new_tokens": 2}))
        >>> again.cached_tokens, again.weight_version
        (4, '1')
        >>> bool((again.routes[:4] == first.routes[:4]).all())  # stale: cached before the update
        True
    """

    def __init__(self, model: ServedModel, cache: PrefixCache | None = None, *, weight_version: str = "0") -> None:
        if not isinstance(model, ServedModel):
            raise TypeError(f"model must implement torch_r3.testing.ServedModel, got {type(model).__name__}")
        self.model = model
        self.cache = cache
        self._weight_version = weight_version
        self._updates = 0
        self._lock = threading.Lock()

    @property
    def weight_version(self) -> str:
        """The version of the weights requests run with now."""
        return self._weight_version

    def generate(self, request: GenerateRequest) -> Generation:
        """Generate for `request`; cached prefix rows replace the fresh ones.

        Raises:
            ModelOutputError: The model returned a route array of the wrong shape.
            ValueError: The model rejected the request (or `TypeError`, as it raises).
        """
        with self._lock:
            out = self.model.generate(request.prompt, request.sampling_params)
            routes = np.asarray(out.routes)
            expected = (len(request.prompt) + len(out.token_ids) - 1, self.model.num_layers, self.model.topk)
            if routes.shape != expected:
                raise ModelOutputError(f"model returned routes of shape {routes.shape}, expected {expected}")
            hit = 0
            if self.cache is not None:
                hit, cached = self.cache.match(request.salt, request.prompt)
                if hit:
                    routes = routes.copy()
                    routes[:hit] = cached
                self.cache.store(request.salt, request.prompt + list(out.token_ids), routes)
            return Generation(
                token_ids=list(out.token_ids),
                logprobs=list(out.logprobs),
                routes=routes,
                finish_reason=out.finish_reason,
                cached_tokens=hit,
                weight_version=self._weight_version,
            )

    def aborted(self) -> Generation:
        """The result of a request aborted before any forward pass."""
        return Generation([], [], None, "abort", 0, self._weight_version)

    def update_weights(self, *, weight_version: str | None = None, flush_cache: bool = False) -> str:
        """Load the next weights (`ServedModel.update_weights`) and bump the version.

        Args:
            weight_version: The new version's name; `str(number of updates)` by default.
            flush_cache: Also drop the prefix cache.

        Returns:
            The new weight version.
        """
        if weight_version is not None:
            check_str(weight_version, "weight_version")
        with self._lock:
            self.model.update_weights(self._updates + 1)
            self._updates += 1
            self._weight_version = weight_version if weight_version is not None else str(self._updates)
            if flush_cache and self.cache is not None:
                self.cache.clear()
            return self._weight_version

    def flush_cache(self) -> None:
        """Drop the prefix cache (no-op without one)."""
        with self._lock:
            if self.cache is not None:
                self.cache.clear()
