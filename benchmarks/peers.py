"""The peers' collations `python -m benchmarks.compare` times beside torch_r3's, in our own code.

They are comparisons, not part of torch_r3: they live in the checkout and are
registered into `torch_r3.bench` (`torch_r3.bench.register`) when this module
is imported, so that `torch-r3 bench --strategies` and
`torch_r3.bench.run_shape` accept them by name. Each one's output is checked
bit-identical to the run's reference before any timing counts, as torch_r3's
own strategies' are.

- `baseline`: what users run without torch_r3: allocate the full `[B, T, L, K]`
  buffer, fill all of it with the padding row (a NumPy broadcast), re-compact
  every sample (`torch_r3.compact_routes`: scan min and max, copy to the
  narrowest dtype), then copy the samples in one by one, on one thread.
- `SkyRL-style padded` and `SkyRL-style packed`: what SkyRL's merged
  collation does today: each trajectory written once into a fresh padded
  `[B, T, L, K]` buffer (its padding rows and its routes, then both masks),
  one trajectory after another on one thread; and the packed form, every
  trajectory's routes (padding rows for its uncaptured tail) concatenated into
  a fresh `[N, L, K]` buffer with `cu_seqlens`, also serial.
- `pad_sequence`: `torch.nn.utils.rnn.pad_sequence(padding_side="left")` plus
  fixing the padding rows, as a PyTorch user would write it by hand.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_r3.bench import STRATEGIES, Strategy, register, registered
from torch_r3.bench.config import TORCH_DTYPES
from torch_r3.bench.strategies import (
    FRESH,
    GATHER,
    MEMCPY,
    PACKED,
    PACKED_GATHER,
    PACKED_STEADY,
    REUSED,
    SERIAL,
    STEADY,
    Context,
)
from torch_r3.keys import ATTENTION_MASK, CU_SEQLENS, ROUTER_MASK, ROUTES
from torch_r3.routes import compact_routes

__all__ = ["BASELINE", "COMPARE_ORDER", "PAD_SEQUENCE", "PEERS", "SKYRL_PACKED", "SKYRL_PADDED"]

BASELINE = "baseline"
SKYRL_PADDED = "SkyRL-style padded"
SKYRL_PACKED = "SkyRL-style packed"
PAD_SEQUENCE = "pad_sequence"


def _baseline(ctx: Context) -> dict[str, torch.Tensor]:
    """prefill the whole padded buffer, re-compact every sample, copy them in one by one (one thread)."""
    b = ctx.batch
    B, T, L, K = len(b.routes), b.T, b.num_layers, b.topk
    routes = torch.empty((B, T, L, K), dtype=TORCH_DTYPES[b.dtype.name])
    out = routes.numpy()
    out[...] = np.arange(K, dtype=b.dtype)  # prefill every row with the padding route
    mask = np.ones((B, T), dtype=bool)
    att = np.zeros((B, T), dtype=np.int64)
    for i, (a, n) in enumerate(zip(b.routes, b.token_counts)):
        a = compact_routes(a, health=None)  # the receiver distrusts the sender: min/max scan and a copy
        s = T - n
        out[i, s : s + a.shape[0]] = a
        mask[i, s : s + a.shape[0]] = False
        att[i, s:] = 1
    return {ROUTES: routes, ROUTER_MASK: torch.from_numpy(mask), ATTENTION_MASK: torch.from_numpy(att)}


def _skyrl_padded(ctx: Context) -> dict[str, torch.Tensor]:
    """what SkyRL's merged collation does: one serial write per trajectory into a fresh padded buffer."""
    b = ctx.batch
    B, T, L, K = len(b.routes), b.T, b.num_layers, b.topk
    routes = torch.empty((B, T, L, K), dtype=TORCH_DTYPES[b.dtype.name])
    mask = torch.empty((B, T), dtype=torch.bool)
    att = torch.empty((B, T), dtype=torch.long)
    out, m, a = routes.numpy(), mask.numpy(), att.numpy()
    pad = np.arange(K, dtype=b.dtype)
    for i, (src, n) in enumerate(zip(b.routes, b.token_counts)):  # one trajectory after another, one thread
        s = T - n
        e = s + src.shape[0]
        out[i, :s] = pad
        out[i, s:e] = src
        out[i, e:] = pad
        m[i, :s], m[i, s:e], m[i, e:] = True, False, True
        a[i, :s], a[i, s:] = 0, 1
    return {ROUTES: routes, ROUTER_MASK: mask, ATTENTION_MASK: att}


def _skyrl_packed(ctx: Context) -> dict[str, torch.Tensor]:
    """SkyRL's packed form: the trajectories concatenated into a fresh buffer with cu_seqlens, serially."""
    b = ctx.batch
    L, K = b.num_layers, b.topk
    pad = np.broadcast_to(np.arange(K, dtype=b.dtype), (1, L, K))
    parts, masks = [], []
    for src, n in zip(b.routes, b.token_counts):
        tail = n - src.shape[0]  # tokens without a captured route: padding rows
        parts += [src, np.broadcast_to(pad, (tail, L, K))] if tail else [src]
        masks += [np.zeros(src.shape[0], bool), np.ones(tail, bool)]
    cu = np.zeros(len(b.token_counts) + 1, dtype=np.int32)
    np.cumsum(b.token_counts, out=cu[1:])
    routes = np.concatenate(parts).astype(b.dtype, copy=False)
    return {
        ROUTES: torch.from_numpy(routes),
        ROUTER_MASK: torch.from_numpy(np.concatenate(masks)),
        CU_SEQLENS: torch.from_numpy(cu),
    }


def _pad_sequence(ctx: Context) -> dict[str, torch.Tensor]:
    """torch.nn.utils.rnn.pad_sequence plus fixing the padding rows, as written by hand."""
    b = ctx.batch
    T, L, K = b.T, b.num_layers, b.topk
    tdtype = TORCH_DTYPES[b.dtype.name]
    pad_row = torch.arange(K, dtype=tdtype).expand(L, K)
    seqs = []
    for a, n in zip(b.routes, b.token_counts):
        t = torch.from_numpy(a).to(tdtype)
        if n > t.shape[0]:  # the uncaptured tail gets padding routes
            t = torch.cat([t, pad_row.expand(n - t.shape[0], L, K)])
        seqs.append(t)
    routes = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_side="left")
    counts = torch.tensor(b.token_counts)
    rows = torch.tensor([a.shape[0] for a in b.routes])
    pos = torch.arange(T)
    start = (T - counts)[:, None]
    att = pos >= start
    routes[~att] = pad_row  # pad_sequence left-pads with the scalar 0: fix those rows
    mask = ~(att & (pos < start + rows[:, None]))
    return {ROUTES: routes, ROUTER_MASK: mask, ATTENTION_MASK: att.long()}


#: The peers, as registered (each one's description is its docstring's first line).
PEERS = (
    Strategy(BASELINE, _baseline, "padded"),
    Strategy(SKYRL_PADDED, _skyrl_padded, "padded"),
    Strategy(SKYRL_PACKED, _skyrl_packed, "packed"),
    Strategy(PAD_SEQUENCE, _pad_sequence, "padded"),
)

#: The side-by-side run, in order: the baseline first (every padded output is
#: checked against it), torch_r3's strategies, the peers, the floors.
COMPARE_ORDER = (
    BASELINE,
    SERIAL,
    FRESH,
    REUSED,
    STEADY,
    PACKED,
    PACKED_STEADY,
    SKYRL_PADDED,
    SKYRL_PACKED,
    GATHER,
    PACKED_GATHER,
    MEMCPY,
    PAD_SEQUENCE,
)
assert set(COMPARE_ORDER) == set(STRATEGIES) | {p.name for p in PEERS}  # every strategy, each once

for _peer in PEERS:
    if _peer.name not in registered():  # once per process, however this module was reached
        register(_peer)
