"""Draws docs/img/data-path.svg, the architecture page's data path (run by hand; tests check it is current).

Plain SVG text, no plotting library: the stages of the data path from the inference engine
to the trainer, each under the folder of `torch_r3` that does it, and beneath them the
payloads every stage carries and the layers that move batches between processes.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

OUT = Path(__file__).with_name("data-path.svg")

# (title, folder, two lines of what it does)
STAGES = [
    ("inference engine", "vLLM, SGLang, in-process", ("generates and captures", "the routes")),
    ("rollout", "torch_r3.rollout", ("client, codec, trace,", "one protocol per server")),
    ("health", "torch_r3.health", ("refuses routes a", "capture bug wrote")),
    ("collate", "torch_r3.collate", ("the training batch,", "every byte once")),
    ("replay", "torch_r3.replay", ("checks, layer map,", "stats (no framework)")),
    ("trainer", "megatron, transformers", ("hooks make each router", "pick the routes")),
]
BOX_W, BOX_H, GAP, X0, Y0 = 160, 92, 24, 16, 16
WIDTH = X0 * 2 + len(STAGES) * BOX_W + (len(STAGES) - 1) * GAP
HEIGHT = 236
FONT = "font-family:DejaVu Sans,Verdana,sans-serif"
ENGINE, STAGE, HOOK, LINE = "#e8e8e8", "#dbe6f4", "#fbe3cc", "#333333"


def text(x: float, y: float, value: str, size: int = 12, weight: str = "normal", fill: str = LINE) -> str:
    return (
        f'<text x="{x:.0f}" y="{y:.0f}" text-anchor="middle" style="{FONT};font-size:{size}px;'
        f'font-weight:{weight}" fill="{fill}">{escape(value)}</text>'
    )


def svg() -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-labelledby="title">',
        '<title id="title">torch_r3\'s data path: engine, rollout, health, collate, replay, trainer</title>',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{LINE}"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
    ]
    for i, (title, folder, lines) in enumerate(STAGES):
        x = X0 + i * (BOX_W + GAP)
        fill = ENGINE if i == 0 else HOOK if i == len(STAGES) - 1 else STAGE
        parts.append(f'<rect x="{x}" y="{Y0}" width="{BOX_W}" height="{BOX_H}" rx="8" fill="{fill}" stroke="{LINE}"/>')
        center = x + BOX_W / 2
        parts.append(text(center, Y0 + 22, title, 14, "bold"))
        parts.append(text(center, Y0 + 41, folder, 11, fill="#1f4e8c"))
        parts += [text(center, Y0 + 62 + 15 * k, line, 11) for k, line in enumerate(lines)]
        if i:
            y = Y0 + BOX_H / 2
            parts.append(
                f'<line x1="{x - GAP + 2}" y1="{y}" x2="{x - 2}" y2="{y}" stroke="{LINE}" '
                'stroke-width="2" marker-end="url(#arrow)"/>'
            )
    # the payloads ride every stage between rollout and the trainer
    left, right = X0 + BOX_W + GAP, WIDTH - X0
    y = Y0 + BOX_H + 30
    parts.append(f'<rect x="{left}" y="{y - 16}" width="{right - left}" height="26" rx="5" fill="#f3f3f3"/>')
    parts.append(
        text(
            (left + right) / 2,
            y + 2,
            "payloads: torch_r3.routes (MoE routes), torch_r3.selections (DSA indexer top-k)",
            12,
        )
    )
    y += 40
    parts.append(f'<rect x="{left}" y="{y - 16}" width="{right - left}" height="26" rx="5" fill="#f3f3f3"/>')
    parts.append(
        text(
            (left + right) / 2,
            y + 2,
            "across processes: torch_r3.ray, torch_r3.distributed, torch_r3.integrations (SkyRL, verl)",
            12,
        )
    )
    y += 40
    parts.append(
        text(
            WIDTH / 2,
            y,
            "tools on top: runlog, report, doctor, cli, bench, demo, testing (the loopback server)",
            11,
            fill="#555555",
        )
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(svg(), encoding="utf-8")
    print(f"wrote {OUT}")
