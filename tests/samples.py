"""The one seeded builder of route samples for the tests, beside the reference collator.

`router_routes` draws `[rows, layers, topk]` expert ids the way a router picks
them: `topk` distinct experts per token and layer (never the all-zero or
repeated rows the engine-health check refuses), uniform by default, or top-k
without replacement from a Zipf-skewed popularity with a different ranking per
layer (`skew=`), like an unbalanced router.
`route_samples` builds the trajectories a rollout hands the collator: token
ids, routes for a prefix of the tokens (the captured rows), the canonical
dtypes mixed as asked, and the extra keys a trainer sends along.

Like `tests.reference_collate`, it imports nothing from `torch_r3`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["EXPERTS_IN", "EXTRAS", "route_samples", "router_routes"]

#: Experts per layer for routes of each canonical dtype that should use its range: every uint8 id,
#: and ids past uint8 in the wider dtypes.
EXPERTS_IN = {np.uint8: 256, np.int16: 300, np.int32: 300}

#: The extra keys `route_samples` can add to each sample, and what each holds.
EXTRAS = {
    "loss_mask": "float32 0/1 per token",
    "reward": "a float in [0, 1)",
    "prompt_length": "an int in [0, n]",
    "uid": "the sample's index",
}


def _generator(seed: int | np.random.Generator) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def router_routes(
    seed: int | np.random.Generator,
    rows: int,
    num_layers: int = 3,
    topk: int = 2,
    *,
    num_experts: int = 8,
    dtype: type | np.dtype = np.uint8,
    skew: float | None = None,
) -> np.ndarray:
    """`[rows, num_layers, topk]` expert ids a router could choose: `topk` distinct experts per token and layer.

    By default each token's first expert is uniform and the others follow it at
    random distinct offsets (modulo `num_experts`): a draw of `rows * L * K`
    integers, cheap at any expert count. With `skew`, each layer ranks its
    experts by a Zipf popularity `1 / rank**skew` (a random ranking per layer)
    and each token takes `topk` experts without replacement from it (Gumbel
    top-k), as under a real, unbalanced router; that draws `num_experts` keys
    per token and layer.
    """
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk={topk} must be in 1..num_experts={num_experts}")
    if np.iinfo(dtype).max < num_experts - 1:
        raise ValueError(f"dtype {np.dtype(dtype)} cannot hold expert ids up to {num_experts - 1}")
    rng = _generator(seed)
    if skew is not None:
        weights = np.log(np.arange(1, num_experts + 1, dtype=np.float64) ** -skew)
        popularity = weights[np.argsort(rng.random((num_layers, num_experts)), axis=1)]  # [L, E]
        keys = popularity + rng.gumbel(size=(rows, num_layers, num_experts))
        return np.argsort(-keys, axis=-1)[..., :topk].astype(dtype)
    first = rng.integers(0, num_experts, size=(rows, num_layers, 1))
    if topk == 1:
        return first.astype(dtype)
    # K - 1 positive steps whose sum stays below E: the K offsets are distinct modulo E.
    steps = rng.integers(1, (num_experts - 1) // (topk - 1) + 1, size=(rows, num_layers, topk - 1))
    offsets = np.concatenate([np.zeros_like(first), np.cumsum(steps, axis=-1)], axis=-1)
    return ((first + offsets) % num_experts).astype(dtype)


def route_samples(
    seed: int | np.random.Generator,
    lengths: Sequence[int | None] | None = None,
    *,
    n: int | tuple[int, int] = 6,
    min_tokens: int = 1,
    max_tokens: int = 12,
    captured: str | Sequence[int] | Callable[[int, int], int] = "some",
    num_layers: int = 3,
    topk: int = 2,
    num_experts: int = 8,
    dtypes: Sequence[type | np.dtype] = (np.uint8,),
    moe_layers: Sequence[int] | None = None,
    token_ids: tuple[int, int] | None = (1, 1000),
    extras: Iterable[str] = (),
    skew: float | None = None,
) -> list[dict]:
    """Seeded trajectories as a rollout hands them to `R3Collator`: `input_ids`, `routes` and `extras`.

    Args:
        seed: A seed or a generator (shared with the caller's other draws).
        lengths: Each trajectory's token count; drawn in `[min_tokens, max_tokens]` when
            `None`, and so is each `None` entry (`[max_tokens, None, None]`: three
            trajectories, the first one the longest).
        n: How many trajectories when the lengths are drawn: a count, or a
            `(low, high)` range to draw it from (`high` excluded).
        min_tokens, max_tokens: The shortest and longest drawn length.
        captured: How many leading tokens of trajectory `i` (of `n_i`) have routes:
            `"some"` draws it in `[0, n_i]`, `"all"` is `n_i`, `"all_but_last"`
            `n_i - 1` (the last sampled token uncaptured); or a sequence of row
            counts, or a function `(i, n_i) -> rows`.
        num_layers, topk, num_experts: The routes' `[L, K]` and the experts per layer.
        dtypes: Trajectory `i` gets `dtypes[i % len(dtypes)]`, to mix canonical dtypes.
        moe_layers: Only these columns of `L` hold routes; the others (dense
            layers) are zero rows. All of them when `None`.
        token_ids: The `[low, high)` range of the token ids, or `None` for none.
        extras: Keys of `EXTRAS` to add to each sample.
        skew: The routers' Zipf skew, or `None` for uniform experts (`router_routes`).
    """
    rng = _generator(seed)
    extras = list(extras)
    unknown = set(extras) - set(EXTRAS)
    if unknown:
        raise ValueError(f"unknown extras {sorted(unknown)}; expected some of {sorted(EXTRAS)}")
    if lengths is None:
        lengths = [None] * (n if isinstance(n, int) else int(rng.integers(*n)))
    lengths = [int(rng.integers(min_tokens, max_tokens + 1)) if length is None else length for length in lengths]
    columns = list(range(num_layers)) if moe_layers is None else list(moe_layers)
    samples = []
    for i, length in enumerate(lengths):
        if captured == "some":
            rows = int(rng.integers(0, length + 1))
        elif captured == "all":
            rows = length
        elif captured == "all_but_last":
            rows = length - 1
        elif callable(captured):
            rows = captured(i, length)
        elif isinstance(captured, Sequence) and not isinstance(captured, str):
            rows = int(captured[i])
        else:
            raise ValueError(f"captured={captured!r}: expected 'some', 'all', 'all_but_last', rows or a function")
        dtype = dtypes[i % len(dtypes)]
        routes = np.zeros((rows, num_layers, topk), dtype)
        routes[:, columns] = router_routes(
            rng, rows, len(columns), topk, num_experts=num_experts, dtype=dtype, skew=skew
        )
        sample: dict = {}
        if token_ids is not None:
            sample["input_ids"] = rng.integers(*token_ids, size=length).tolist()
        sample["routes"] = routes
        if "loss_mask" in extras:
            sample["loss_mask"] = rng.integers(0, 2, size=length).astype(np.float32)
        if "reward" in extras:
            sample["reward"] = float(rng.random())
        if "prompt_length" in extras:
            sample["prompt_length"] = int(rng.integers(0, length + 1))
        if "uid" in extras:
            sample["uid"] = i
        samples.append(sample)
    return samples
