"""The torch.distributed fallback: a source rank sends each rank only its own trajectories.

Without Ray (or any object store), the trajectories of a step sit on one rank,
and the cheapest thing that still scales with the batch is to send each rank
exactly its trajectories, unpadded, and let it collate its micro-batches
locally (with `torch_r3.ShardCollator`). Compared with scattering a padded
global batch this halves the bytes on the wire for left-padded RL batches, and
no rank ever holds another rank's routes. It still keeps a hub: every byte of
the step leaves the source rank, whose link and memory bound the step. It is
the fallback, not the scale path; the scale path is `torch_r3.ray`.

`scatter_trajectories` is a collective: every rank of the group calls it, the
source with the samples and the plan. Each rank receives, besides its own
samples, the step's metadata (every trajectory's token count and route dtype),
so it can compute `torch_r3.global_geometry` itself.

What arrives is untrusted input at a process boundary: every header, count,
shape and dtype is checked, and the total size is bounded by `max_bytes`,
before any buffer is allocated. Only plain tensors cross the wire (no pickle).
Backends: gloo (CPU tensors; what the tests run) and NCCL (each message staged
through the current CUDA device; not exercised by the test suite, which runs on CPUs).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torch_r3.keys import INPUT_IDS, SAMPLE_ROUTES
from torch_r3.routes import CANONICAL_DTYPES

__all__ = ["DEFAULT_MAX_BYTES", "MAX_NDIM", "RankShard", "scatter_trajectories"]

DEFAULT_MAX_BYTES = 64 * 2**30
"""The most payload bytes a rank accepts in one `scatter_trajectories` call, by default."""

MAX_NDIM = 4
"""The most dimensions a sample's array may have on the wire."""

_MAGIC = 0x52335F5348415244  # "R3_SHARD": a stray message from another protocol is refused at once
_VERSION = 1
_MAX_SCHEMA_BYTES = 1 << 16
_MAX_KEYS = 256
_MAX_SAMPLES = 1 << 24
_ALIGN = 8  # every sample's bytes start 8-aligned, so any dtype views them in place

# The wire's dtype codes; a code outside this table is refused.
_DTYPES = [np.dtype(t) for t in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")]
_CODE = {dt: c for c, dt in enumerate(_DTYPES)}
_ROW = 2 + MAX_NDIM  # per sample and key: dtype code, ndim, dims


@dataclasses.dataclass(frozen=True)
class RankShard:
    """What one rank received: its micro-batches, its samples and the step's metadata.

    Attributes:
        microbatches: this rank's micro-batches, each a list of global sample indices.
        samples: `{global index: sample dict}` for every index in `microbatches`;
            arrays are NumPy views of one receive buffer per key.
        token_counts: every trajectory's token count, in global order.
        route_dtypes: every trajectory's route dtype, in global order.
    """

    microbatches: list[list[int]]
    samples: dict[int, dict[str, Any]]
    token_counts: list[int]
    route_dtypes: list[np.dtype]

    def fetch(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples of `indices`, in order: the `fetch` of `torch_r3.ShardCollator`."""
        return [self.samples[i] for i in indices]


# --------------------------------------------------------------------------
# Source side: turn samples into a schema, a shape table and one buffer per key
# --------------------------------------------------------------------------


def _wire_array(value: Any, i: int, key: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    elif isinstance(value, (list, tuple, bool, int, float, np.generic)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise TypeError(f"sample {i}: key {key!r} must be an array, tensor, list or number, got {type(value).__name__}")
    if value.dtype not in _CODE:
        raise TypeError(f"sample {i}: key {key!r} has dtype {value.dtype}, not one of {[d.name for d in _DTYPES]}")
    if value.ndim > MAX_NDIM:
        raise ValueError(f"sample {i}: key {key!r} has {value.ndim} dimensions, at most {MAX_NDIM} cross the wire")
    return np.require(value, requirements="C")  # ascontiguousarray would make 0-d arrays 1-d


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _encode(
    samples: Sequence[Mapping[str, Any]], indices: list[int], keys: list[str]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    table = np.zeros((len(indices), len(keys), _ROW), dtype=np.int64)
    payloads = []
    for k, key in enumerate(keys):
        arrays = []
        for s, g in enumerate(indices):
            if key not in samples[g]:
                raise ValueError(f"sample {g}: missing key {key!r} (sample 0 has it)")
            a = _wire_array(samples[g][key], g, key)
            table[s, k, 0], table[s, k, 1] = _CODE[a.dtype], a.ndim
            table[s, k, 2 : 2 + a.ndim] = a.shape
            arrays.append(a)
        buf = np.zeros(sum(_aligned(a.nbytes) for a in arrays), dtype=np.uint8)
        offset = 0
        for a in arrays:
            buf[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
            offset += _aligned(a.nbytes)
        payloads.append(torch.from_numpy(buf))
    return torch.from_numpy(table), payloads


def _check_plan(samples: Any, plan: Any, world: int) -> list[list[list[int]]]:
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"samples: expected a sequence of sample dicts on the source rank, got {samples!r:.80}")
    if not samples:
        raise ValueError("samples: expected at least one sample on the source rank, got none")
    if not isinstance(plan, Sequence) or len(plan) != world:
        raise ValueError(f"plan: expected one list of micro-batches per rank ({world}), got {plan!r:.80}")
    seen = [0] * len(samples)
    out = []
    for r, mbs in enumerate(plan):
        rank_mbs = []
        for m, mb in enumerate(mbs):
            ids = [int(i) for i in mb]
            for i in ids:
                if not 0 <= i < len(samples):
                    raise ValueError(f"plan[{r}][{m}]: sample index {i} outside [0, {len(samples)})")
                seen[i] += 1
            rank_mbs.append(ids)
        out.append(rank_mbs)
    twice = [i for i, n in enumerate(seen) if n > 1]
    if twice:
        raise ValueError(f"plan: samples {twice[:8]} are assigned more than once")
    return out


# --------------------------------------------------------------------------
# Receiver side: every field checked, sizes bounded, before allocating
# --------------------------------------------------------------------------


def _check_header(header: list[int], src: int, max_bytes: int) -> None:
    magic, version, num_global, num_mb, num_samples, num_keys, schema_len, payload = header
    if magic != _MAGIC or version != _VERSION:
        raise ValueError(f"rank {src} sent a header that is not a torch_r3 shard (v{_VERSION}): {header[:2]}")
    for name, value, most in (
        ("global samples", num_global, _MAX_SAMPLES),
        ("micro-batches", num_mb, _MAX_SAMPLES),
        ("samples", num_samples, _MAX_SAMPLES),
        ("keys", num_keys, _MAX_KEYS),
        ("schema bytes", schema_len, _MAX_SCHEMA_BYTES),
    ):
        if not 0 <= value <= most:
            raise ValueError(f"rank {src} announced {value} {name}; expected 0..{most}")
    if num_samples > num_global:
        raise ValueError(f"rank {src} announced {num_samples} samples of a {num_global}-sample step")
    # Everything this rank will allocate for the call: payload, shape table, metadata, schema.
    tables = 8 * (2 * num_global + num_mb + num_samples + num_samples * num_keys * _ROW) + schema_len
    if payload < 0 or payload + tables > max_bytes:
        raise ValueError(
            f"rank {src} announced {payload} payload bytes and {tables} bytes of tables; "
            f"this rank accepts at most {max_bytes} (max_bytes)"
        )


def _decode_keys(schema: torch.Tensor, num_keys: int, src: int) -> list[str]:
    try:
        keys = json.loads(bytes(schema.numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"rank {src} sent an unreadable key schema: {e}") from None
    if not isinstance(keys, list) or len(keys) != num_keys or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"rank {src} sent a key schema that is not {num_keys} key names: {keys!r:.80}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"rank {src} sent duplicate keys: {keys}")
    return keys


def _check_table(table: np.ndarray, keys: list[str], indices: np.ndarray, src: int) -> list[int]:
    """Each key's payload size, from a shape table whose every entry was range-checked."""
    sizes = []
    for k, key in enumerate(keys):
        total = 0
        for s in range(table.shape[0]):
            code, ndim, *dims = (int(x) for x in table[s, k])
            if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_NDIM:
                raise ValueError(
                    f"sample {int(indices[s])}: key {key!r} has dtype code {code}, ndim {ndim} on the wire"
                )
            if any(d < 0 for d in dims) or any(dims[ndim:]):
                raise ValueError(f"sample {int(indices[s])}: key {key!r} has an invalid shape {dims} on the wire")
            n = _DTYPES[code].itemsize
            for d in dims[:ndim]:
                n *= d  # Python ints: no overflow, and the sum is bounded by the header below
            total += _aligned(n)
        sizes.append(total)
    return sizes


def _split(buf: np.ndarray, table: np.ndarray, k: int) -> list[np.ndarray]:
    out, offset = [], 0
    for s in range(table.shape[0]):
        code, ndim = int(table[s, k, 0]), int(table[s, k, 1])
        shape = tuple(int(d) for d in table[s, k, 2 : 2 + ndim])
        dt = _DTYPES[code]
        n = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        out.append(buf[offset : offset + n].view(dt).reshape(shape))
        offset += _aligned(n)
    return out


def _check_samples(
    samples: dict[int, dict[str, Any]], counts: list[int], routes_key: str, tokens_key: str, src: int
) -> None:
    for g, s in samples.items():
        if routes_key not in s or tokens_key not in s:
            raise ValueError(f"rank {src} sent sample {g} without {routes_key!r} or {tokens_key!r}")
        routes, tokens = s[routes_key], s[tokens_key]
        if routes.dtype not in CANONICAL_DTYPES or routes.ndim != 3:
            raise ValueError(f"sample {g}: {routes_key!r} arrived as {routes.dtype} {routes.shape}, expected [r, L, K]")
        if tokens.ndim != 1 or tokens.shape[0] != counts[g] or routes.shape[0] > counts[g]:
            raise ValueError(
                f"sample {g}: {tokens.shape} tokens and {routes.shape[0]} route rows arrived for a planned "
                f"{counts[g]}-token trajectory"
            )


# --------------------------------------------------------------------------
# The collective
# --------------------------------------------------------------------------


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group: dist.ProcessGroup | None, r: int) -> int:
    # send/recv take global ranks; the plan and `src` are in the group's ranks.
    return r if group is None else dist.get_global_rank(group, r)


def _send(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
    dist.send(t.to(device), dst=dst, group=group)


def _recv(
    shape: tuple[int, ...], dtype: torch.dtype, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=src, group=group)
    return t.cpu()


def _send_rank(
    samples: Sequence[Mapping[str, Any]],
    plan_r: Sequence[Sequence[int]],
    counts: Sequence[int],
    dtypes: Sequence[np.dtype],
    keys: list[str],
    dst: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    indices = [i for mb in plan_r for i in mb]
    table, payloads = _encode(samples, indices, keys)
    schema = torch.frombuffer(bytearray(json.dumps(keys).encode("utf-8")), dtype=torch.uint8)
    payload_bytes = sum(p.numel() for p in payloads)
    header = [_MAGIC, _VERSION, len(counts), len(plan_r), len(indices), len(keys), schema.numel(), payload_bytes]
    _send(torch.tensor(header, dtype=torch.int64), dst, group, device)
    _send(schema, dst, group, device)
    meta = torch.tensor([[n, _CODE[np.dtype(d)]] for n, d in zip(counts, dtypes)], dtype=torch.int64)
    _send(meta, dst, group, device)
    _send(torch.tensor([len(mb) for mb in plan_r] + indices, dtype=torch.int64), dst, group, device)
    _send(table, dst, group, device)
    for p in payloads:
        if p.numel():
            _send(p, dst, group, device)


def _recv_rank(
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    max_bytes: int,
    routes_key: str,
    tokens_key: str,
) -> RankShard:
    header = _recv((8,), torch.int64, src, group, device).tolist()
    _check_header(header, src, max_bytes)
    _, _, num_global, num_mb, num_samples, num_keys, schema_len, payload = header
    keys = _decode_keys(_recv((schema_len,), torch.uint8, src, group, device), num_keys, src)
    meta = _recv((num_global, 2), torch.int64, src, group, device).numpy()
    if (meta[:, 0] <= 0).any() or not ((meta[:, 1] >= 0) & (meta[:, 1] < len(_DTYPES))).all():
        raise ValueError(f"rank {src} sent token counts <= 0 or unknown route dtype codes in the step's metadata")
    counts, dtypes = meta[:, 0].tolist(), [_DTYPES[c] for c in meta[:, 1].tolist()]
    layout = _recv((num_mb + num_samples,), torch.int64, src, group, device).numpy()
    sizes, indices = layout[:num_mb], layout[num_mb:]
    if (sizes < 0).any() or int(sizes.sum()) != num_samples:
        raise ValueError(f"rank {src} sent micro-batch sizes {sizes.tolist()[:8]} that do not sum to {num_samples}")
    if ((indices < 0) | (indices >= num_global)).any() or len(set(indices.tolist())) != num_samples:
        raise ValueError(f"rank {src} sent sample indices outside [0, {num_global}) or repeated")
    table = _recv((num_samples, num_keys, _ROW), torch.int64, src, group, device).numpy()
    key_sizes = _check_table(table, keys, indices, src)
    if sum(key_sizes) != payload:
        raise ValueError(f"rank {src} announced {payload} payload bytes, its shapes describe {sum(key_sizes)}")
    columns = []
    for k, n in enumerate(key_sizes):
        buf = _recv((n,), torch.uint8, src, group, device).numpy() if n else np.zeros(0, np.uint8)
        columns.append(_split(buf, table, k))
    samples = {int(g): {key: columns[k][s] for k, key in enumerate(keys)} for s, g in enumerate(indices)}
    _check_samples(samples, counts, routes_key, tokens_key, src)
    bounds = np.cumsum([0, *sizes.tolist()])
    mbs = [indices[bounds[m] : bounds[m + 1]].tolist() for m in range(num_mb)]
    return RankShard(mbs, samples, counts, dtypes)


def scatter_trajectories(
    samples: Sequence[Mapping[str, Any]] | None,
    plan: Sequence[Sequence[Sequence[int]]] | None,
    *,
    src: int = 0,
    group: Any = None,
    routes_key: str = SAMPLE_ROUTES,
    tokens_key: str = INPUT_IDS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> RankShard:
    """Send each rank only its own trajectories, unpadded; every rank returns its `RankShard`.

    A collective over `group`: every rank calls it. On `src`, `samples` is the
    step's list of sample dicts (routes `[r, L, K]` compacted, token ids, any
    other array or number keys, the same keys in every sample) and `plan` has,
    per rank of the group, its micro-batches as lists of global sample indices
    (`torch_r3.plan_microbatches` makes one). Elsewhere both are `None`. The
    source keeps its own share without a copy; every other rank gets a header,
    the step's metadata, its shape table and one buffer per key, all checked
    before use.

    Args:
        samples: the step's samples on `src`, `None` elsewhere.
        plan: per rank its micro-batches on `src`, `None` elsewhere.
        src: the group rank that holds the samples.
        group: the process group (default: the world).
        routes_key: the samples' key for their routes.
        tokens_key: the samples' key for their token ids.
        max_bytes: the most payload bytes this rank accepts; a larger
            announcement is refused before allocating.

    Returns:
        This rank's `RankShard`.

    Raises:
        TypeError: on `src`, a sample value of an unsupported kind or dtype.
        ValueError: on `src`, a plan that is not one list per rank or assigns a
            sample twice; on a receiver, anything that arrives malformed,
            inconsistent or larger than `max_bytes`.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = _device(group)
    if rank != src:
        return _recv_rank(_global_rank(group, src), group, device, max_bytes, routes_key, tokens_key)
    checked = _check_plan(samples, plan, world)
    assert samples is not None  # _check_plan refused None
    for key in (routes_key, tokens_key):
        if key not in samples[0]:
            raise ValueError(f"sample 0: missing key {key!r}")
    keys = list(samples[0])
    for i in (i for mbs in checked for mb in mbs for i in mb):
        if not isinstance(samples[i], Mapping):
            raise TypeError(f"sample {i}: expected a mapping (dict), got {type(samples[i]).__name__}")
        if set(samples[i]) != set(keys):
            raise ValueError(f"sample {i}: keys differ from sample 0 in {sorted(set(samples[i]) ^ set(keys))}")
    counts = [len(s[tokens_key]) for s in samples]
    dtypes = [_wire_array(s[routes_key], g, routes_key).dtype for g, s in enumerate(samples)]
    for g, d in enumerate(dtypes):
        if d not in CANONICAL_DTYPES:
            raise ValueError(f"sample {g}: {routes_key!r} has dtype {d}, expected uint8/int16/int32 (compact_routes)")
    for r in range(world):
        if r != src:
            _send_rank(samples, checked[r], counts, dtypes, keys, _global_rank(group, r), group, device)
    own = {i: dict(samples[i]) for mb in checked[src] for i in mb}
    return RankShard(checked[src], own, counts, dtypes)
