"""Draws docs/img/route-layout.svg from a real collate_routes call (run by hand)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from torch_r3 import collate_routes

counts = [6, 3, 8]
rows = [5, 3, 6]  # captured prefixes; the rest of each trajectory is an uncaptured tail
routes = [np.ones((r, 1, 2), np.uint8) for r in rows]
padded = collate_routes(routes, counts)
packed = collate_routes(routes, counts, layout="packed")

COLORS = {"left": "#d9d9d9", "route": "#4c72b0", "tail": "#f0a35e"}


def draw_cells(ax, y, kinds, x0=0):
    for x, kind in enumerate(kinds):
        ax.add_patch(Rectangle((x0 + x, y), 0.92, 0.8, color=COLORS[kind]))


fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 4.2), gridspec_kw={"height_ratios": [3, 1.4]})
T = padded["router_padding_mask"].shape[1]
att = padded["attention_mask"].numpy()
mask = padded["router_padding_mask"].numpy()
for i in range(len(counts)):
    kinds = ["left" if att[i, t] == 0 else ("tail" if mask[i, t] else "route") for t in range(T)]
    draw_cells(a1, len(counts) - 1 - i, kinds)
    a1.text(
        -0.4,
        len(counts) - 1 - i + 0.4,
        f"trajectory {i}: n={counts[i]}, r={rows[i]}",
        ha="right",
        va="center",
        fontsize=9,
    )
a1.set_xlim(-7, T + 0.5)
a1.set_ylim(-0.3, len(counts))
a1.set_title(
    'layout="padded": rollout_expert_indices [B, T, L, K], right-aligned like a left-padded token batch', fontsize=10
)
a1.axis("off")

cu = packed["cu_seqlens"].tolist()
pm = packed["router_padding_mask"].numpy()
draw_cells(a2, 0, ["tail" if m else "route" for m in pm])
for c in cu:
    a2.axvline(c - 0.04, color="black", lw=1.2)
    a2.text(c, 1.0, str(c), ha="center", fontsize=8)
a2.set_xlim(-7, len(pm) + 0.5)
a2.set_ylim(-0.3, 1.4)
a2.text(-0.4, 0.4, "cu_seqlens", ha="right", va="center", fontsize=9)
a2.set_title('layout="packed": rollout_expert_indices [sum(n), L, K] with cu_seqlens', fontsize=10)
a2.axis("off")
fig.legend(
    handles=[
        Patch(color=COLORS["route"], label="captured route (mask False)"),
        Patch(color=COLORS["tail"], label="uncaptured tail: padding route (mask True)"),
        Patch(color=COLORS["left"], label="left padding: padding route (mask True, attention 0)"),
    ],
    loc="lower center",
    ncol=3,
    fontsize=8,
    frameon=False,
)
fig.tight_layout(rect=(0, 0.07, 1, 1))
fig.savefig(Path(__file__).with_name("route-layout.svg"))
