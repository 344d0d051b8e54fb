"""An independent reference for indexer selections: made-up captures, sizes and batches, by plain loops.

It imports nothing from `torch_r3`: the batch key names, the `-1` fill and
the coding costs are spelled out here from the documented layout, so that a
mistake in the package cannot hide in its own reference.
"""

from __future__ import annotations

import numpy as np

FILL = -1


def random_capture(rng, rows, layers, topk, *, style="uniform", share=()):
    """A dense capture `[rows, layers, topk]` int32 as SGLang sends it.

    Row `j < topk` is `0..j` then -1; a longer row is `topk` distinct positions in `[0, j]`, in random
    order. `style="local"` picks mostly recent positions plus a few early ones (what trained indexers
    do); `share` lists layers that copy the layer before them.
    """
    out = np.empty((rows, layers, topk), dtype=np.int32)
    for j in range(rows):
        for layer in range(layers):
            if j < topk:
                out[j, layer] = list(range(j + 1)) + [FILL] * (topk - j - 1)
                continue
            if style == "uniform":
                pick = rng.choice(j + 1, topk, replace=False)
            else:
                recent = min(j + 1, topk // 2 + int(rng.integers(0, topk // 4 + 1)))
                near = np.arange(j + 1 - recent, j + 1)
                rest = rng.choice(j + 1 - recent, topk - recent, replace=False)
                pick = np.concatenate([near, rest])
            out[j, layer] = rng.permutation(pick)
    for layer in share:
        out[:, layer] = out[:, layer - 1]
    return out


def sorted_rows(dense):
    """The capture with each row's positions sorted ascending and the -1 slots last."""
    out = np.array(dense, dtype=np.int64)
    for idx in np.ndindex(out.shape[:-1]):
        row = sorted(int(v) for v in out[idx] if v != FILL)
        out[idx] = row + [FILL] * (out.shape[-1] - len(row))
    return out


def expected_nbytes(dense):
    """Bytes of the documented compact form: per stored row the smaller of gap bytes and bitmap, plus
    one mode bit per stored row, for each layer not equal to the layer before it; plus one byte per layer."""
    rows, layers, topk = dense.shape
    exc_size = 2 if rows <= 1 << 16 else 4
    total = layers
    for layer in range(layers):
        if layer and np.array_equal(dense[:, layer], dense[:, layer - 1]):
            continue
        stored = max(rows - topk, 0)
        total += (stored + 7) // 8
        for j in range(topk, rows):
            row = sorted(int(v) for v in dense[j, layer])
            prev, delta = -1, topk
            for p in row:
                if p - prev - 1 >= 255:
                    delta += exc_size
                prev = p
            bitmap = (j + 1 + 7) // 8
            total += bitmap if bitmap < delta else delta
    return total


def reference_collate(dense_list, counts, *, layout="padded", padding_side="left", seq_len=None, keep_layers=None):
    """What `collate_selections` must return, as NumPy arrays, built one position at a time."""
    layers = dense_list[0].shape[1]
    keep = list(range(layers)) if keep_layers is None else list(keep_layers)
    topk = dense_list[0].shape[2]
    B = len(dense_list)
    if layout == "padded":
        T = max(counts) if seq_len is None else seq_len
        sel = np.full((B, T, len(keep), topk), 99999, dtype=np.int64)
        mask = np.zeros((B, T), dtype=bool)
        att = np.zeros((B, T), dtype=np.int64)
        for b, (dense, n) in enumerate(zip(dense_list, counts)):
            shift = T - n if padding_side == "left" else 0
            srt = sorted_rows(dense)
            for t in range(T):
                j = t - shift  # the trajectory's own position
                att[b, t] = 1 if 0 <= j < n else 0
                captured = 0 <= j < dense.shape[0]
                mask[b, t] = not captured
                for k, layer in enumerate(keep):
                    for slot in range(topk):
                        if captured and srt[j, layer, slot] != FILL:
                            sel[b, t, k, slot] = srt[j, layer, slot] + shift
                        else:
                            sel[b, t, k, slot] = FILL
        return {"rollout_indexer_topk": sel, "indexer_padding_mask": mask, "attention_mask": att}
    N = sum(counts)
    sel = np.full((N, len(keep), topk), 99999, dtype=np.int64)
    mask = np.zeros(N, dtype=bool)
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    for b, dense in enumerate(dense_list):
        srt = sorted_rows(dense)
        for j in range(counts[b]):
            t = cu[b] + j
            captured = j < dense.shape[0]
            mask[t] = not captured
            for k, layer in enumerate(keep):
                for slot in range(topk):
                    v = srt[j, layer, slot] if captured else FILL
                    sel[t, k, slot] = FILL if v == FILL else v + cu[b]
    return {"rollout_indexer_topk": sel, "indexer_padding_mask": mask, "cu_seqlens": np.array(cu)}
