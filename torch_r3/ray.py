"""Routes through Ray's object store: rollout actors put, trainer ranks fetch their own.

At cluster scale the global batch is the problem (a DeepSeek-V3 step at
B = 1024 and 32k responses holds about 8 GB of routes, 16 GB left-padded), so
no process should hold all of it. Here each rollout actor puts each
trajectory into the object store once, as NumPy arrays (zero-copy on
`ray.get` since Ray stores them as out-of-band buffers), and hands the
controller a `TrajectoryRef`: the object ref plus the metadata that plans the
step (token count, route dtype and shape). The controller plans micro-batches
from that metadata alone and passes each trainer rank the refs of its own
trajectories; the rank resolves one micro-batch at a time with `RefFetch`,
which is the `fetch` callable `torch_r3.ShardCollator` takes.

Public names:

* `put_trajectory(sample)` -> `TrajectoryRef` (call it on the rollout actor).
* `TrajectoryRef`: the small, picklable handle the controller passes around.
* `token_counts(refs)`, `route_dtypes(refs)`: the metadata `torch_r3.global_geometry`
  and `torch_r3.plan_microbatches` take.
* `RefFetch(refs)`: `fetch(indices)` -> the samples of those global indices,
  checked against their metadata.

Ownership follows Ray's rule: an object lives as long as its owner (the
process that called `ray.put`, here the rollout actor) and some ref to it.
Keep rollout actors alive until the step's trainers have fetched, or Ray
raises `OwnerDiedError` on the trainer.

This module needs the `ray` extra (`pip install 'torch_r3[ray]'`); `import
torch_r3` never imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torch_r3._extras import require
from torch_r3.keys import INPUT_IDS, SAMPLE_ROUTES
from torch_r3.routes import CANONICAL_DTYPES

ray = require("ray", "ray")

__all__ = ["RefFetch", "TrajectoryRef", "put_trajectory", "route_dtypes", "token_counts"]


@dataclasses.dataclass(frozen=True)
class TrajectoryRef:
    """One trajectory in the object store: its ref and the metadata that plans a step.

    About 200 bytes pickled, whatever the trajectory's size: this is what the
    controller receives from rollout actors and sends to trainer ranks.

    Attributes:
        ref: the `ray.ObjectRef` of the sample dict (NumPy arrays inside).
        num_tokens: the trajectory's token count `n`.
        num_rows: captured route rows `r <= n` (the tail has no route).
        num_layers: the routes' layer axis `L`.
        topk: the routes' `K`.
        dtype: the routes' dtype name (`"uint8"`, `"int16"` or `"int32"`).
    """

    ref: Any
    num_tokens: int
    num_rows: int
    num_layers: int
    topk: int
    dtype: str

    @property
    def route_bytes(self) -> int:
        """Bytes of the trajectory's route array in the object store."""
        return self.num_rows * self.num_layers * self.topk * np.dtype(self.dtype).itemsize


def _host_array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{what}: expected a host array, got a tensor on {value.device}; move it with .cpu()")
        # CPU tensors are serialised in-band by Ray (copied twice); NumPy arrays are zero-copy.
        return value.detach().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"{what}: expected a NumPy array or a CPU tensor, got {type(value).__name__}")


def _store_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        return np.require(value.detach().numpy(), requirements="C")
    if isinstance(value, np.ndarray):
        return np.require(value, requirements="C")  # ascontiguousarray would make 0-d arrays 1-d
    return value


def put_trajectory(
    sample: Mapping[str, Any],
    *,
    routes_key: str = SAMPLE_ROUTES,
    tokens_key: str = INPUT_IDS,
) -> TrajectoryRef:
    """Put one trajectory's sample into the object store; return its ref and metadata.

    Call it where the trajectory is produced (the rollout actor), once per
    trajectory. Arrays and CPU tensors are stored as contiguous NumPy arrays,
    so a trainer's `ray.get` maps them without a copy; a token list becomes
    an array by NumPy's rules (Python ints: `int64`). Other keys (a reward, a
    loss mask) are stored as given, arrays and CPU tensors as NumPy arrays.

    Args:
        sample: the sample as `torch_r3.R3Collator` takes it: compacted routes
            `[r, L, K]` (`uint8`/`int16`/`int32`, see `torch_r3.compact_routes`),
            token ids, and any other keys.
        routes_key: the sample's key for its routes.
        tokens_key: the sample's key for its token ids.

    Returns:
        The `TrajectoryRef` to hand the controller.

    Raises:
        TypeError: the sample is not a mapping, or its routes/tokens are not arrays.
        ValueError: a missing key, a non-canonical dtype, a wrong shape, or more
            route rows than tokens.
    """
    if not isinstance(sample, Mapping):
        raise TypeError(f"sample: expected a mapping (dict), got {type(sample).__name__}")
    for key in (routes_key, tokens_key):
        if key not in sample:
            raise ValueError(f"sample: missing key {key!r}")
    routes = _host_array(sample[routes_key], f"sample[{routes_key!r}]")
    if routes.dtype not in CANONICAL_DTYPES:
        raise ValueError(
            f"sample[{routes_key!r}]: expected a canonical dtype (native uint8, int16 or int32), got "
            f"{routes.dtype.str}; compact it first with torch_r3.compact_routes"
        )
    if routes.ndim != 3 or routes.shape[1] == 0 or routes.shape[2] == 0:
        raise ValueError(f"sample[{routes_key!r}]: expected shape [rows, layers > 0, topk > 0], got {routes.shape}")
    tokens = sample[tokens_key]
    # Lists become arrays by NumPy's rules (Python ints -> int64); a float stays a float and is refused.
    tokens = np.asarray(tokens) if isinstance(tokens, (list, tuple)) else _host_array(tokens, tokens_key)
    if tokens.ndim != 1 or tokens.shape[0] == 0 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"sample[{tokens_key!r}]: expected a non-empty 1-D array of integer token ids, "
            f"got shape {tokens.shape} and dtype {tokens.dtype}"
        )
    if routes.shape[0] > tokens.shape[0]:
        raise ValueError(
            f"sample[{routes_key!r}]: {routes.shape[0]} route rows for {tokens.shape[0]} tokens "
            f"(captured rows are a prefix of the tokens)"
        )
    stored = {key: _store_value(value) for key, value in sample.items() if key not in (routes_key, tokens_key)}
    stored[routes_key] = np.ascontiguousarray(routes)
    stored[tokens_key] = np.ascontiguousarray(tokens)
    return TrajectoryRef(
        ref=ray.put(stored),
        num_tokens=int(tokens.shape[0]),
        num_rows=int(routes.shape[0]),
        num_layers=int(routes.shape[1]),
        topk=int(routes.shape[2]),
        dtype=routes.dtype.name,
    )


def _check_refs(refs: Any) -> list[TrajectoryRef]:
    if not isinstance(refs, Sequence) or isinstance(refs, (str, bytes)):
        raise TypeError(f"refs: expected a sequence of TrajectoryRef, got {type(refs).__name__}")
    for i, t in enumerate(refs):
        if not isinstance(t, TrajectoryRef):
            raise TypeError(f"refs[{i}]: expected a TrajectoryRef (from put_trajectory), got {type(t).__name__}")
    return list(refs)


def token_counts(refs: Sequence[TrajectoryRef]) -> list[int]:
    """Each trajectory's token count, for `global_geometry` and `plan_microbatches`.

    Args:
        refs: the step's trajectories, in global batch order.

    Returns:
        `[n_0, n_1, ...]`.
    """
    return [t.num_tokens for t in _check_refs(refs)]


def route_dtypes(refs: Sequence[TrajectoryRef]) -> list[np.dtype]:
    """Each trajectory's route dtype, for `global_geometry`.

    Args:
        refs: the step's trajectories, in global batch order.

    Returns:
        One NumPy dtype per trajectory.
    """
    return [np.dtype(t.dtype) for t in _check_refs(refs)]


class RefFetch:
    """`fetch(indices)` for `torch_r3.ShardCollator`: resolve a micro-batch's refs here.

    Built on the trainer rank from the refs the controller sent it, indexed by
    global sample index (a dict, or the whole step's list). Each call resolves
    only the requested trajectories with one `ray.get` (the arrays map the
    object store read-only, no copy) and checks each against the metadata the
    step was planned with, since a sample that changed shape or dtype after
    planning would no longer fit the global layout.

    Args:
        refs: `{global index: TrajectoryRef}` or a sequence indexed by global index.
        routes_key: the samples' key for their routes.
        tokens_key: the samples' key for their token ids.
        timeout: seconds `ray.get` may wait (`None`: no limit).

    Raises:
        TypeError: `refs` holds something other than `TrajectoryRef`.
    """

    def __init__(
        self,
        refs: Mapping[int, TrajectoryRef] | Sequence[TrajectoryRef],
        *,
        routes_key: str = SAMPLE_ROUTES,
        tokens_key: str = INPUT_IDS,
        timeout: float | None = None,
    ) -> None:
        if isinstance(refs, Mapping):
            items = list(refs.items())
            _check_refs([t for _, t in items])
            self.refs = {int(i): t for i, t in items}
        else:
            self.refs = dict(enumerate(_check_refs(refs)))
        self.routes_key = routes_key
        self.tokens_key = tokens_key
        self.timeout = timeout

    def __repr__(self) -> str:
        return (
            f"RefFetch({len(self.refs)} trajectories, routes_key={self.routes_key!r}, tokens_key={self.tokens_key!r})"
        )

    def __call__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples of `indices`, in that order, checked against their metadata.

        Raises:
            KeyError: an index this rank holds no ref for.
            TypeError: a resolved object is not a sample mapping.
            ValueError: a sample's routes or tokens differ from its metadata.
        """
        metas = []
        for i in indices:
            if i not in self.refs:
                raise KeyError(f"sample {i}: this rank holds no ref for it (it has {len(self.refs)} refs)")
            metas.append(self.refs[i])
        samples = ray.get([t.ref for t in metas], timeout=self.timeout)
        for i, meta, sample in zip(indices, metas, samples):
            self._check(i, meta, sample)
        return samples

    def _check(self, i: int, meta: TrajectoryRef, sample: Any) -> None:
        if not isinstance(sample, Mapping) or self.routes_key not in sample or self.tokens_key not in sample:
            raise TypeError(
                f"sample {i}: expected a mapping with {self.routes_key!r} and {self.tokens_key!r}, "
                f"got {type(sample).__name__}"
            )
        routes, tokens = sample[self.routes_key], sample[self.tokens_key]
        want = (meta.num_rows, meta.num_layers, meta.topk)
        if not isinstance(routes, np.ndarray) or routes.shape != want or routes.dtype.name != meta.dtype:
            got = (getattr(routes, "shape", None), getattr(routes, "dtype", type(routes).__name__))
            raise ValueError(f"sample {i}: routes {got} differ from the planned shape {want} and dtype {meta.dtype}")
        if not isinstance(tokens, np.ndarray) or tokens.shape != (meta.num_tokens,):
            raise ValueError(
                f"sample {i}: {self.tokens_key!r} has shape {getattr(tokens, 'shape', None)}, "
                f"planned ({meta.num_tokens},)"
            )
