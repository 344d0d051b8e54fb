"""The one independent reference collator, shared by test_collate.py and test_bench.py.

It builds each batch one token position at a time, straight from the batch
layout in `docs/concepts/route-layout.md`, with plain Python loops and NumPy
arrays. It imports nothing from `torch_r3` (the key names are spelled out here
on purpose) so that a mistake in the package cannot hide in its own reference.
"""

from __future__ import annotations

import numpy as np
import torch

# Canonical route dtypes, narrowest first: a mixed batch takes the widest.
ROUTE_DTYPES = [np.uint8, np.int16, np.int32]


def padding_row(t, num_layers, topk, filler="arange", num_experts=None):
    """The filler route `[L, K]` of filler position `t` (global row + position from the first token)."""
    if filler == "arange":
        row = list(range(topk))
    else:
        row = [(t * topk + j) % num_experts for j in range(topk)]
    return np.array([row] * num_layers)


def reference_collate_routes(
    routes,
    counts,
    *,
    layout="padded",
    pad_to_multiple_of=None,
    filler="arange",
    num_experts=None,
    seq_len=None,
    dtype=None,
    keep_layers=None,
    sample_ids=None,
):
    """What `collate_routes` must return, as NumPy arrays, built position by position.

    `dtype` is a NumPy scalar type, `keep_layers` a list of layer indices, `sample_ids` the global rows.
    """
    if keep_layers is not None:
        routes = [r[:, list(keep_layers)] for r in routes]
    L, K = routes[0].shape[1:]
    ids = list(range(len(routes))) if sample_ids is None else list(sample_ids)
    # The widest input dtype, widened further when a filler id would not fit it.
    largest_pad_id = K - 1 if filler == "arange" else num_experts - 1
    fits = min(i for i, d in enumerate(ROUTE_DTYPES) if np.iinfo(d).max >= largest_pad_id)
    if dtype is None:
        dtype = ROUTE_DTYPES[max([fits] + [ROUTE_DTYPES.index(r.dtype.type) for r in routes])]
    B = len(routes)
    if layout == "padded":
        T = max(counts) if seq_len is None else seq_len
        if pad_to_multiple_of:
            while T % pad_to_multiple_of:
                T += 1
        out = np.zeros((B, T, L, K), dtype)
        mask = np.zeros((B, T), bool)
        att = np.zeros((B, T), np.int64)
        for i in range(B):
            s = T - counts[i]
            r = routes[i].shape[0]
            for t in range(T):
                if s <= t < s + r:
                    out[i, t] = routes[i][t - s]
                else:
                    out[i, t] = padding_row(ids[i] + t - s, L, K, filler, num_experts)
                    mask[i, t] = True
                att[i, t] = 1 if t >= s else 0
        return {"rollout_expert_indices": out, "router_padding_mask": mask, "attention_mask": att}
    rows_out, mask, cu = [], [], [0]
    for i in range(B):
        for j in range(counts[i]):
            if j < routes[i].shape[0]:
                rows_out.append(routes[i][j])
                mask.append(False)
            else:
                rows_out.append(padding_row(ids[i] + j, L, K, filler, num_experts))
                mask.append(True)
        cu.append(cu[-1] + counts[i])
    return {
        "rollout_expert_indices": np.array(rows_out, dtype).reshape(-1, L, K),
        "router_padding_mask": np.array(mask, bool),
        "cu_seqlens": np.array(cu, np.int32),
    }


def reference_r3_collator(
    samples,
    *,
    pad_token_id=0,
    layout="padded",
    pad_keys=None,
    routes_key="routes",
    tokens_key="input_ids",
    filler="arange",
    num_experts=None,
    pad_to_multiple_of=None,
    **geometry,
):
    """What `R3Collator` must return for `samples`, as NumPy arrays.

    `geometry` (`seq_len`, `dtype`, `keep_layers`, `sample_ids`) goes to `reference_collate_routes`.

    `pad_keys` maps a per-token key to `(pad value, NumPy dtype)`; every other
    key is stacked with `np.array`, as `default_collate` does for numbers.
    """
    pad_keys = pad_keys or {}
    routes = [s[routes_key] for s in samples]
    counts = [len(s[tokens_key]) for s in samples]
    want = reference_collate_routes(
        routes,
        counts,
        layout=layout,
        pad_to_multiple_of=pad_to_multiple_of,
        filler=filler,
        num_experts=num_experts,
        **geometry,
    )
    per_token = {"input_ids": (tokens_key, pad_token_id, np.int64)}
    per_token.update({k: (k, pad, dt) for k, (pad, dt) in pad_keys.items()})
    for out_key, (key, pad, dt) in per_token.items():
        seqs = [list(np.asarray(s[key])) for s in samples]
        if layout == "padded":
            T = want["router_padding_mask"].shape[1]
            want[out_key] = np.array([[pad] * (T - len(x)) + x for x in seqs], dt)
        else:
            want[out_key] = np.array([v for x in seqs for v in x], dt)
    for key in samples[0]:
        if key not in (routes_key, tokens_key, *pad_keys):
            want[key] = np.array([s[key] for s in samples])
    return want


def assert_batch_equal(got, want):
    """`got` (tensors) equals `want` (arrays) key by key, dtype included."""
    assert set(got) == set(want)
    for k, v in want.items():
        expected = torch.from_numpy(np.ascontiguousarray(v))
        assert got[k].dtype == expected.dtype, (k, got[k].dtype, expected.dtype)
        assert torch.equal(got[k], expected), k


def reference_padded(routes, counts):
    """The padded layout with `arange` filler (the benchmark's shape)."""
    return reference_collate_routes(routes, counts, layout="padded")


def reference_packed(routes, counts):
    """The packed layout with `arange` filler (the benchmark's shape)."""
    return reference_collate_routes(routes, counts, layout="packed")
