"""How a documented demo table is compared with the table a run prints, on any CPU.

The demo's figures are not all properties of the product. Replay makes the training
routes equal the rollout's: 100.00% agreement with replay, exactly, on every machine. And
the token counts are fixed by the demo's shapes. But without replay the agreement counts
bf16-vs-fp32 near-ties, and which way a near-tie falls depends on the last bit of a bf16
matmul, which differs between CPUs (x86-64 with or without AVX-512/AMX, ARM) and torch
builds; a flipped route also changes what the rollout samples after it. Those figures are
compared within the tolerances below, which are several times the spread measured between
CPUs and kernel paths (the notes in tests/test_docs_figures.py), and still far tighter than
what a demo that stopped replaying, or changed its model or its rollouts, would print.

The rules, by what the documented cell holds:
- the text around the numbers (labels, units, the rows themselves): equal;
- an integer (a token count, a layer index): equal;
- `100.00%` or `0.00%`: equal (replay's guarantee, the live share in filler mode);
- another percentage (agreement or drift without replay): within `PERCENT_POINTS`;
- a float in scientific notation (a log-prob gap, a KL): within a factor (`FACTORS`, by row).
"""

from __future__ import annotations

import re

# One route flip among the 408 captured tokens of a layer moves that layer's agreement by
# 0.25 points; CPUs seen so far differ by at most one flip per layer.
PERCENT_POINTS = 0.75
# Mean |dlogp| and the k3 KL without replay are dominated by the few flipped tokens.
FACTORS = {"k3 KL": 2.0, "|dlogp|": 1.35}
# A number on its own (not the 3 of "k3"): an integer, a decimal, scientific notation, a percentage.
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?%?(?!\w)")


def _factor(label: str) -> float:
    for key, factor in FACTORS.items():
        if key in label:
            return factor
    raise AssertionError(f"no tolerance for a float in the row {label!r}")


def _skeleton(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def cell_mismatch(documented: str, printed: str, label: str) -> str | None:
    """Why `printed` does not match `documented` (a cell of the row `label`), or None."""
    if documented.endswith("%") != printed.endswith("%"):
        return f"{documented} vs {printed}"
    if documented.endswith("%"):
        want, got = float(documented[:-1]), float(printed[:-1])
        if want in (0.0, 100.0):
            return None if got == want else f"{documented} vs {printed} (exact)"
        return (
            None if abs(want - got) <= PERCENT_POINTS else f"{documented} vs {printed} (over {PERCENT_POINTS} points)"
        )
    if "e" in documented:
        want, got = float(documented), float(printed)
        factor = _factor(label)
        if want > 0 and got > 0 and 1 / factor <= got / want <= factor:
            return None
        return f"{documented} vs {printed} (more than a factor {factor})"
    return None if documented == printed else f"{documented} vs {printed} (exact)"


def table_mismatches(documented: str, printed: str) -> list[str]:
    """Every way the documented table differs from the printed one beyond the tolerances."""
    doc, run = documented.rstrip("\n").splitlines(), printed.rstrip("\n").splitlines()
    if [_skeleton(line) for line in doc] != [_skeleton(line) for line in run]:
        doc_rows = [NUMBER.sub("#", line).split("#")[0].strip() for line in doc]
        run_rows = [NUMBER.sub("#", line).split("#")[0].strip() for line in run]
        return [f"the rows or their text differ: documented {doc_rows}, printed {run_rows}"]
    out = []
    for d, r in zip(doc, run):
        label = NUMBER.sub("#", d).split("#")[0].strip()
        for want, got in zip(NUMBER.findall(d), NUMBER.findall(r)):
            why = cell_mismatch(want, got, label)
            if why:
                out.append(f"{label or d.strip()}: {why}")
    return out
