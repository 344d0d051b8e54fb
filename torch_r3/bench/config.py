"""What a benchmark run times: its shape (`BenchConfig`) and the seeded synthetic batch.

A `Batch` holds per-trajectory route arrays as an inference server would send
them (rows = tokens - 1, a few trajectories with a synthetic EOS), their token
counts, and the byte sizes every report and memory estimate is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_r3._checks import check_choice, check_non_negative, check_positive
from torch_r3.collate._pool import check_workers
from torch_r3.collate.collator import padded_length
from torch_r3.routes import canonical_dtype_for

__all__ = [
    "DISTRIBUTIONS",
    "PRESETS",
    "TORCH_DTYPES",
    "Batch",
    "BenchConfig",
    "is_default_shape",
    "make_batch",
    "max_padded_bytes",
    "sequence_lengths",
]

#: Named trajectory-length distributions (see `sequence_lengths`).
DISTRIBUTIONS = ("uniform", "mild_ragged", "typical_rl", "heavy_tail")

#: Named shapes for `--preset`. `default` is the headline shape of the docs.
PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(num_sequences=256, max_seqlen=8192, num_layers=40, topk=8, dtype="uint8"),
    "production": dict(num_sequences=1024, max_seqlen=32768, num_layers=40, topk=22, dtype="int16"),
}

#: Route dtype names and their torch dtypes, narrowest first.
TORCH_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}

# (sigma of the log-normal body, target mean as a fraction of max_seqlen,
# fraction of trajectories truncated at max_seqlen). RL batches nearly always
# hold a few rollouts that hit the generation limit, and those set T.
_SHAPES = {
    "mild_ragged": (0.25, 1 / 2, 0.02),
    "typical_rl": (1.0, 1 / 16, 0.02),
    "heavy_tail": (2.0, 1 / 64, 0.01),
}
_DEFAULT_EXPERTS = {"uint8": 128, "int16": 512, "int32": 1 << 16}
# Fraction of trajectories that carry a synthetic EOS (rows = tokens - 2).
_EOS_FRACTION = 1 / 16


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark shape and how to time it. Validated on construction.

    `num_experts` defaults to 128 (`uint8`), 512 (`int16`) or 65536 (`int32`);
    `dtype` defaults to the narrowest dtype that holds `num_experts - 1`;
    `workers` defaults to `torch_r3.cpu.pool_workers()`.
    """

    num_sequences: int = 256
    max_seqlen: int = 8192
    num_layers: int = 40
    topk: int = 8
    num_experts: int | None = None
    dtype: str | None = None
    distribution: str = "uniform"
    mixed_dtypes: bool = False
    seed: int = 0
    repeats: int = 5
    warmup: int = 1
    workers: int | None = None

    def __post_init__(self) -> None:
        # `warmup` >= 1: the first call is checked, never timed.
        for name in ("num_sequences", "max_seqlen", "num_layers", "topk", "repeats", "warmup"):
            object.__setattr__(self, name, check_positive(getattr(self, name), name))
        object.__setattr__(self, "seed", check_non_negative(self.seed, "seed"))
        if self.workers is not None:
            object.__setattr__(self, "workers", check_workers(self.workers))
        check_choice(self.distribution, "distribution", DISTRIBUTIONS)
        if self.dtype is not None:
            check_choice(self.dtype, "dtype", tuple(TORCH_DTYPES))
        dtype = self.dtype or ("int16" if self.mixed_dtypes else None)
        experts = self.num_experts
        if experts is None:
            experts = _DEFAULT_EXPERTS[dtype or "uint8"]
        else:
            experts = check_positive(experts, "num_experts")
            object.__setattr__(self, "num_experts", experts)
        needed = canonical_dtype_for(experts - 1).name
        if dtype is None:
            dtype = needed
        elif _order(needed) > _order(dtype):
            raise ValueError(
                f"num_experts={experts} needs expert ids up to {experts - 1}, which need {needed}, not {dtype}"
            )
        if self.mixed_dtypes and dtype == "uint8":
            raise ValueError("mixed_dtypes mixes uint8 and int16 senders, so the batch dtype is int16, not uint8")
        if self.topk > experts:
            raise ValueError(
                f"topk={self.topk} needs at least that many experts (a route is topk distinct "
                f"experts), got num_experts={experts}"
            )
        object.__setattr__(self, "num_experts", experts)
        object.__setattr__(self, "dtype", dtype)

    @property
    def label(self) -> str:
        """The shape in one line, as the report and the status lines print it."""
        mixed = ", mixed uint8/int16" if self.mixed_dtypes else ""
        return (
            f"{self.num_sequences} seqs x max {self.max_seqlen} tokens, {self.num_layers} layers, "
            f"topk {self.topk}, {self.num_experts} experts, {self.dtype}{mixed}, {self.distribution}"
        )


def _order(dtype: str) -> int:
    return tuple(TORCH_DTYPES).index(dtype)


def is_default_shape(config: BenchConfig | dict[str, Any]) -> bool:
    """Whether `config` is the `default` preset's batch (timing options and seed aside).

    Args:
        config: a `BenchConfig` or its `dataclasses.asdict` form (as in the JSON).

    Returns:
        True for the shape the project's speed targets are set on.

    Examples:
        >>> is_default_shape(BenchConfig(repeats=3)), is_default_shape(BenchConfig(topk=4))
        (True, False)
    """
    if isinstance(config, BenchConfig):
        config = {
            k: getattr(config, k)
            for k in (
                "num_sequences",
                "max_seqlen",
                "num_layers",
                "topk",
                "dtype",
                "distribution",
                "mixed_dtypes",
                "num_experts",
            )
        }
    want = dict(PRESETS["default"], distribution="uniform", mixed_dtypes=False, num_experts=128)
    return all(config.get(k) == v for k, v in want.items())


def sequence_lengths(distribution: str, num_sequences: int, max_seqlen: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts `n_i` in `[1, max_seqlen]` drawn from a named distribution.

    `uniform` draws uniformly in `[1, max_seqlen]`. The others are a log-normal
    body plus a few trajectories truncated at `max_seqlen` (the rollouts that hit
    the generation limit), scaled so the batch mean is about `max/2`
    (`mild_ragged`), `max/16` (`typical_rl`, long tail) or `max/64` (`heavy_tail`).

    Args:
        distribution: one of `DISTRIBUTIONS`.
        num_sequences: how many lengths.
        max_seqlen: the largest length.
        rng: the random generator (seeded by the caller).

    Returns:
        An `int64` array of `num_sequences` lengths.

    Raises:
        ValueError: `distribution` is not one of `DISTRIBUTIONS`.

    Examples:
        >>> lengths = sequence_lengths("typical_rl", 64, 1024, np.random.default_rng(0))
        >>> int(lengths.min()) >= 1, int(lengths.max())
        (True, 1024)
    """
    if distribution == "uniform":
        return rng.integers(1, max_seqlen + 1, size=num_sequences, dtype=np.int64)
    check_choice(distribution, "distribution", DISTRIBUTIONS)
    sigma, mean_fraction, truncated = _SHAPES[distribution]
    body = np.exp(sigma * rng.standard_normal(num_sequences))
    hit_limit = rng.choice(num_sequences, size=max(1, round(truncated * num_sequences)), replace=False)
    target = mean_fraction * max_seqlen
    scale = target / body.mean()
    lengths = np.ones(num_sequences, dtype=np.int64)
    for _ in range(30):  # clipping and the truncated rollouts move the mean: rescale until it settles
        lengths = np.clip(np.rint(body * scale), 1, max_seqlen).astype(np.int64)
        lengths[hit_limit] = max_seqlen
        mean = lengths.mean()
        if abs(mean - target) <= 0.01 * target or num_sequences == len(hit_limit):
            break
        rest = num_sequences - len(hit_limit)
        want_rest = max(target * num_sequences - max_seqlen * len(hit_limit), rest)
        have_rest = max(lengths.sum() - max_seqlen * len(hit_limit), 1)
        scale *= want_rest / have_rest
    return lengths


@dataclass
class Batch:
    """A synthetic batch: per-trajectory routes and token counts, plus its sizes in bytes.

    `padded_bytes` counts `rollout_expert_indices`, `router_padding_mask` and
    `attention_mask` of the padded layout; `packed_bytes` the routes, the mask
    and `cu_seqlens` of the packed one.
    """

    routes: list[np.ndarray]
    token_counts: list[int]
    dtype: np.dtype
    T: int
    input_bytes: int
    padded_bytes: int
    packed_bytes: int

    @property
    def num_layers(self) -> int:
        """`L`, the MoE layers of every route array."""
        return self.routes[0].shape[1]

    @property
    def topk(self) -> int:
        """`K`, the experts per token of every route array."""
        return self.routes[0].shape[2]


def _route_array(rng: np.random.Generator, rows: int, L: int, K: int, experts: int, dtype: np.dtype) -> np.ndarray:
    # K distinct experts per row, as a real route: a random first expert, then
    # its K-1 successors modulo the expert count.
    ids = rng.integers(0, experts, size=(rows, L, 1), dtype=np.int32) + np.arange(K, dtype=np.int32)
    if experts & (experts - 1) == 0:
        np.bitwise_and(ids, experts - 1, out=ids)
    else:
        np.remainder(ids, experts, out=ids)
    return ids.astype(dtype)


def make_batch(config: BenchConfig) -> Batch:
    """Build the seeded synthetic batch of `config`.

    Route rows per trajectory are `tokens - 1` (the last sampled token is never
    run forward); one trajectory in 16 carries a synthetic EOS (`tokens - 2`).
    With `mixed_dtypes` every other trajectory comes from a `uint8` sender
    (expert ids < 256), the rest from `int16` senders.

    Args:
        config: the shape and seed.

    Returns:
        The `Batch`.

    Examples:
        >>> batch = make_batch(BenchConfig(num_sequences=4, max_seqlen=16, num_layers=2, topk=2))
        >>> len(batch.routes), batch.routes[0].shape[1:], batch.T == max(batch.token_counts)
        (4, (2, 2), True)
    """
    rng = np.random.default_rng(config.seed)
    counts = sequence_lengths(config.distribution, config.num_sequences, config.max_seqlen, rng)
    rows = counts - 1
    can_eos = np.flatnonzero(counts >= 2)
    if len(can_eos):
        k = min(len(can_eos), max(1, round(_EOS_FRACTION * config.num_sequences)))
        rows[rng.choice(can_eos, size=k, replace=False)] -= 1
    L, K = config.num_layers, config.topk
    E: int = config.num_experts  # type: ignore[assignment]  # __post_init__ resolved None to the default
    dtype = np.dtype(config.dtype)
    routes = []
    for i, r in enumerate(rows):
        if config.mixed_dtypes and i % 2 == 1:
            routes.append(_route_array(rng, int(r), L, K, min(E, 256), np.dtype(np.uint8)))
        else:
            routes.append(_route_array(rng, int(r), L, K, E, dtype))
    T = padded_length(counts.tolist())
    B, N = len(routes), int(counts.sum())
    row_bytes = L * K * dtype.itemsize
    return Batch(
        routes=routes,
        token_counts=[int(n) for n in counts],
        dtype=dtype,
        T=T,
        input_bytes=sum(a.nbytes for a in routes),
        padded_bytes=B * T * (row_bytes + 1 + 8),
        packed_bytes=N * (row_bytes + 1) + 4 * (B + 1),
    )


def max_padded_bytes(config: BenchConfig) -> int:
    """The padded batch's bytes at the longest `T` the shape allows (`max_seqlen`): an upper bound.

    Counts `rollout_expert_indices`, `router_padding_mask` and the int64
    `attention_mask`, as `Batch.padded_bytes` does for a drawn batch.

    Examples:
        >>> max_padded_bytes(BenchConfig(num_sequences=2, max_seqlen=4, num_layers=3, topk=2))
        120
    """
    row = config.num_layers * config.topk * np.dtype(config.dtype).itemsize
    return config.num_sequences * config.max_seqlen * (row + 1 + 8)
