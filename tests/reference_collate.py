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
    elif filler == "zeros":
        row = [0] * topk
    else:
        row = [(t * topk + j) % num_experts for j in range(topk)]
    return np.array([row] * num_layers)


def reference_collate_routes(
    routes,
    counts,
    *,
    layout="padded",
    padding_side="left",
    prompt_width=None,
    response_width=None,
    prompt_lengths=None,
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
    The padded and prompt_response layouts place sample `i`'s first real token at a start `s_i`:
    `T - n_i` (left), `0` (right), `prompt_width - p_i` (prompt_response); the packed layout with
    `pad_to_multiple_of` gives each sequence its own aligned span.
    """
    if keep_layers is not None:
        routes = [r[:, list(keep_layers)] for r in routes]
    L, K = routes[0].shape[1:]
    ids = list(range(len(routes))) if sample_ids is None else list(sample_ids)
    # The widest input dtype, widened further when a filler id would not fit it.
    largest_pad_id = {"arange": K - 1, "zeros": 0}.get(filler, None if num_experts is None else num_experts - 1)
    fits = min(i for i, d in enumerate(ROUTE_DTYPES) if np.iinfo(d).max >= largest_pad_id)
    if dtype is None:
        dtype = ROUTE_DTYPES[max([fits] + [ROUTE_DTYPES.index(r.dtype.type) for r in routes])]
    B = len(routes)
    if layout in ("padded", "prompt_response"):
        if layout == "prompt_response":
            T = prompt_width + response_width
            starts = [prompt_width - p for p in prompt_lengths]
        else:
            T = max(counts) if seq_len is None else seq_len
            if pad_to_multiple_of:
                while T % pad_to_multiple_of:
                    T += 1
            starts = [T - n if padding_side == "left" else 0 for n in counts]
        out = np.zeros((B, T, L, K), dtype)
        mask = np.zeros((B, T), bool)
        att = np.zeros((B, T), np.int64)
        for i in range(B):
            s = starts[i]
            r = routes[i].shape[0]
            for t in range(T):
                if s <= t < s + r:
                    out[i, t] = routes[i][t - s]
                else:
                    out[i, t] = padding_row(ids[i] + t - s, L, K, filler, num_experts)
                    mask[i, t] = True
                att[i, t] = 1 if s <= t < s + counts[i] else 0
        return {"rollout_expert_indices": out, "router_padding_mask": mask, "attention_mask": att}
    rows_out, mask, cu, cu_padded = [], [], [0], [0]
    for i in range(B):
        span = counts[i]
        if pad_to_multiple_of:
            while span % pad_to_multiple_of:
                span += 1
        for j in range(span):
            if j < routes[i].shape[0]:
                rows_out.append(routes[i][j])
                mask.append(False)
            else:
                rows_out.append(padding_row(ids[i] + j, L, K, filler, num_experts))
                mask.append(True)
        cu.append(cu[-1] + counts[i])
        cu_padded.append(cu_padded[-1] + span)
    want = {
        "rollout_expert_indices": np.array(rows_out, dtype).reshape(-1, L, K),
        "router_padding_mask": np.array(mask, bool),
        "cu_seqlens": np.array(cu, np.int32),
    }
    if pad_to_multiple_of:
        want["cu_seqlens_padded"] = np.array(cu_padded, np.int32)
    return want


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
    padding_side="left",
    prompt_width=None,
    response_width=None,
    prompt_length_key="prompt_length",
    **geometry,
):
    """What `R3Collator` must return for `samples`, as NumPy arrays.

    `geometry` (`seq_len`, `dtype`, `keep_layers`, `sample_ids`) goes to `reference_collate_routes`.
    With `layout="prompt_response"` each sample's prompt length is its `prompt_length_key`.

    `pad_keys` maps a per-token key to `(pad value, NumPy dtype)`; every other
    key is stacked with `np.array`, as `default_collate` does for numbers.
    """
    pad_keys = pad_keys or {}
    routes = [s[routes_key] for s in samples]
    counts = [len(s[tokens_key]) for s in samples]
    prompts = [int(s[prompt_length_key]) for s in samples] if layout == "prompt_response" else None
    want = reference_collate_routes(
        routes,
        counts,
        layout=layout,
        padding_side=padding_side,
        prompt_width=prompt_width,
        response_width=response_width,
        prompt_lengths=prompts,
        pad_to_multiple_of=pad_to_multiple_of,
        filler=filler,
        num_experts=num_experts,
        **geometry,
    )
    per_token = {"input_ids": (tokens_key, pad_token_id, np.int64)}
    per_token.update({k: (k, pad, dt) for k, (pad, dt) in pad_keys.items()})
    for out_key, (key, pad, dt) in per_token.items():
        seqs = [list(np.asarray(s[key])) for s in samples]
        if layout != "packed":
            # Real tokens where attention_mask is 1, in order; pad everywhere else.
            rows = []
            for x, att in zip(seqs, want["attention_mask"]):
                it = iter(x)
                rows.append([next(it) if a else pad for a in att])
            want[out_key] = np.array(rows, dt)
        else:
            cu = want.get("cu_seqlens_padded", want["cu_seqlens"])
            flat = []
            for i, x in enumerate(seqs):
                flat += x + [pad] * (int(cu[i + 1] - cu[i]) - len(x))
            want[out_key] = np.array(flat, dt)
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
