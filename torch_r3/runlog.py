"""The run log: one JSON line per step with R3's metrics, and the readers for it and for Megatron's routing trace.

```python
from torch_r3.runlog import RunLog

with RunLog("run-{rank}.jsonl") as log:  # one file per rank; without {rank} only rank 0 writes
    for step in range(steps):
        ...
        log.write(step, hook.last_stats, loss=loss.item())
```

A line is `{"step": 3, "rank": 0, "time": 1764620000.5, "metrics": {...}, "meta": {...}}`:
`metrics` is `ReplayStats.as_dict()` (or any flat `{name: number}`); `meta` holds the
keyword arguments of `write` (JSON scalars: `run="baseline"`, `replay=False`, a loss, a
reward). `torch-r3 report` draws the page from these lines; `read_run_log` reads them back.

JSON has no NaN or infinity, and a diverging run logs exactly those, so `write` records
them instead of raising in the training loop: a metric's NaN is `null`, its infinities the
strings `"inf"` and `"-inf"` (a metric is otherwise a number, so the string is unambiguous);
a meta value's NaN or infinity is the string `"nan"`, `"inf"` or `"-inf"`, and the line's
`"nonfinite_meta"` lists those keys (so `run="inf"` stays a string). `read_run_log` gives
back the floats.

A crash mid-write leaves a torn last line (a line's first bytes, no newline). A `RunLog`
that resumes the file starts its first line on a fresh line, and `read_run_log` skips a
torn line with a `UserWarning` naming it, wherever it sits: only a proper prefix of a line
the writer writes counts as torn (it begins `{"step": ` and is valid JSON up to where it
stops); any other line that is no JSON is refused, as before. A torn line that 0.2.0's
writer appended the next record onto gives that record back.

`read_routing_trace` reads the `router_trace_rank<r>.jsonl` files that Megatron-core
0.19's router tracer writes under `--moe-routing-trace-path` (one line per step, block
and layer, with the layer's `top_indices`), and `trace_expert_load` counts its tokens
per expert, the same figure as `ReplayStats.trainer_load`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from torch_r3._deprecation import warn_external

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_TRACE_LINE_BYTES",
    "RunLog",
    "RunRecord",
    "TraceRecord",
    "read_routing_trace",
    "read_run_log",
    "trace_expert_load",
]

#: The longest run-log line the reader accepts (a step's metrics are a few KiB).
MAX_LINE_BYTES = 1 << 20
#: The longest routing-trace line the reader accepts (one layer's `[tokens, topk]` ids as JSON).
MAX_TRACE_LINE_BYTES = 1 << 28


class RunRecord(NamedTuple):
    """One line of a run log."""

    step: int
    rank: int
    time: float
    metrics: dict[str, float]  # NaN where the log holds null
    meta: dict[str, Any]


class TraceRecord(NamedTuple):
    """One line of Megatron's routing trace: one router call's top-k ids."""

    step: int
    block: str  # "decoder" or "mtp"
    layer: int
    rank: int
    mtp_idx: int | None
    top_indices: np.ndarray  # [num_tokens, topk] int64


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how a meta value's spelling reads back


def _spelling(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _number(value: Any, where: str) -> float | str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else _spelling(value)
    return value


class RunLog:
    """Appends one JSON line per step to a run log.

    Args:
        path: The file. With `{rank}` in it, each rank writes its own file (`run-{rank}.jsonl`);
            without, only rank 0 writes and `write` does nothing on the other ranks, the pattern
            after `reduce_stats` (every rank holds the same figures).
        rank: This process's rank (default: `torch.distributed`'s, 0 when it is not initialized).

    Raises:
        TypeError: When `path` is not a string or path.
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: int | None = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a file path, got {type(path).__name__}")
        self.rank = _rank() if rank is None else rank
        text = os.fspath(path)
        self.path: Path | None = Path(text.replace("{rank}", str(self.rank)))
        if "{rank}" not in text and self.rank != 0:
            self.path = None  # rank 0 writes the reduced figures
        self._file: IO[str] | None = None

    def write(self, step: int, metrics: Any, **meta: Any) -> None:
        """Append the step's line (the first on a fresh line, after a torn one a crash left).

        Args:
            step: The training step (an int >= 0).
            metrics: A `ReplayStats` (its `as_dict()` is written) or a flat `{name: number}`.
            **meta: JSON scalars (str, int, float, bool, None) to keep with the step.

        A NaN or infinite metric or meta value is recorded, not refused (the module's docstring
        says how it is spelled); `read_run_log` reads it back as that float.

        Raises:
            TypeError: When a metric is not a number or a meta value is not a JSON scalar.
            ValueError: When `step` is negative.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"step: expected >= 0, got {step}")
        flat = metrics.as_dict() if hasattr(metrics, "as_dict") else metrics
        if not isinstance(flat, Mapping):
            raise TypeError(
                f"metrics: expected a ReplayStats or a mapping of names to numbers, got {type(metrics).__name__}"
            )
        out = {str(k): _number(v, f"metrics[{k!r}]") for k, v in flat.items()}
        kept: dict[str, Any] = {}
        nonfinite = []
        for key, value in meta.items():
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise TypeError(f"meta {key!r}: expected a str, number, bool or None, got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                value = _spelling(value)
                nonfinite.append(key)
            kept[key] = value
        if self.path is None:
            return
        if self._file is None:
            self._file = _open_fresh_line(self.path)
        line: dict[str, Any] = {"step": step, "rank": self.rank, "time": time.time(), "metrics": out, "meta": kept}
        if nonfinite:
            line["nonfinite_meta"] = nonfinite
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (a later `write` opens it again, appending)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_fresh_line(path: Path) -> IO[str]:
    """The log opened for appending, on a line of its own: a crash mid-write left its last line without a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as file:
        if file.tell() > 0:
            file.seek(-1, os.SEEK_END)
            if file.read(1) != b"\n":
                file.write(b"\n")  # the torn bytes stay a line of their own; the reader skips it
    return open(path, "a", encoding="utf-8")


_RECORD_START = '{"step": '  # how every line `RunLog.write` writes begins (json.dumps, ASCII)
# what a cut can leave of a number or literal at the end of a line
_PARTIAL_TOKEN = re.compile(r"(?:-?\d*\.?\d*(?:[eE][-+]?\d*)?|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?)\Z")


def _is_torn(text: str) -> bool:
    """Whether `text` is a proper prefix of a line the writer writes: a write cut short."""
    if not (text.startswith(_RECORD_START) or _RECORD_START.startswith(text)) or not text:
        return False
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or e.pos >= len(text):
            return True
        if e.msg.startswith("Invalid \\uXXXX escape"):  # cut inside or right after a \u escape
            return re.fullmatch(r"[0-9a-fA-F]{0,4}", text[text.rfind("\\u") + 2 :]) is not None
        return _PARTIAL_TOKEN.match(text, e.pos) is not None
    return False  # a whole JSON value


def _untorn(text: str, where: str) -> str:
    """The line without the torn writes it begins with (a crash, then a 0.2.0 writer appending on), warned about."""
    starts = [0] + [i for i in range(1, len(text)) if text.startswith(_RECORD_START, i)]
    pieces = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    torn = 0
    while torn < len(pieces) and _is_torn(pieces[torn].rstrip("\r\n")):
        torn += 1
    if torn == 0:
        return text
    warn_external(
        f"{where}: a torn line (a write cut short) is skipped: {sum(map(len, pieces[:torn]))} bytes starting "
        f"{pieces[0][:40]!r}; every other line is read",
        UserWarning,
    )
    return "".join(pieces[torn:])


def _lines(path: str | os.PathLike[str], limit: int, *, torn: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return
            number += 1
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise ValueError(f"{path}:{number}: line longer than {limit} bytes")
            if torn and raw.isascii():
                raw = _untorn(raw.decode("ascii"), f"{path}:{number}").encode("ascii")
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
            yield number, value


def _int_field(value: dict[str, Any], key: str, where: str) -> int:
    v = value.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {key!r} must be an int >= 0, got {v!r}")
    return v


def read_run_log(path: str | os.PathLike[str]) -> list[RunRecord]:
    """Every line of a run log that `RunLog` wrote, in file order.

    NaN and infinities come back as the floats `RunLog.write` was given (a metric's `null`,
    `"inf"` and `"-inf"`; the meta keys listed in `"nonfinite_meta"`).

    Warns:
        UserWarning: For each torn line (a write that a crash cut short), which is skipped;
            the message names the file and the line.

    Raises:
        ValueError: When a line is not JSON (and no torn write), longer than `MAX_LINE_BYTES`,
            or lacks a field (the message names the file, the line and the field).
    """
    records = []
    for number, value in _lines(path, MAX_LINE_BYTES, torn=True):
        where = f"{path}:{number}"
        step, rank = _int_field(value, "step", where), _int_field(value, "rank", where)
        stamp = value.get("time", 0.0)
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
            raise ValueError(f"{where}: 'time' must be a number, got {stamp!r}")
        metrics, meta = value.get("metrics"), value.get("meta", {})
        if not isinstance(metrics, dict):
            raise ValueError(f"{where}: 'metrics' must be an object of numbers, got {type(metrics).__name__}")
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: 'meta' must be an object, got {type(meta).__name__}")
        flat: dict[str, float] = {}
        for k, v in metrics.items():
            if v is None:
                flat[k] = float("nan")
            elif v in ("inf", "-inf"):
                flat[k] = _NONFINITE[v]
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f'{where}: metric {k!r} must be a number or null, "inf" or "-inf", got {v!r}')
            else:
                flat[k] = v
        nonfinite = value.get("nonfinite_meta", [])
        if not isinstance(nonfinite, list):
            raise ValueError(f"{where}: 'nonfinite_meta' must be a list of meta keys, got {type(nonfinite).__name__}")
        for key in nonfinite:
            spelled = meta.get(key) if isinstance(key, str) else None
            if not isinstance(spelled, str) or spelled not in _NONFINITE:
                raise ValueError(
                    f"{where}: meta {key!r} is listed in 'nonfinite_meta' but holds {spelled!r}, "
                    'not "nan", "inf" or "-inf"'
                )
            meta[key] = _NONFINITE[spelled]
        records.append(RunRecord(step, rank, float(stamp), flat, meta))
    return records


def read_routing_trace(path: str | os.PathLike[str]) -> list[TraceRecord]:
    """The records of one Megatron-core 0.19 `router_trace_rank<r>.jsonl` file, in file order.

    Sidecar fields (hidden states, logits) are ignored; read them with Megatron's own loaders.

    Raises:
        ValueError: When a line is not JSON, longer than `MAX_TRACE_LINE_BYTES`, lacks a field, or its
            `top_indices` is not a `[num_tokens, topk]` list of non-negative ints matching its counts.
    """
    records = []
    for number, value in _lines(path, MAX_TRACE_LINE_BYTES):
        where = f"{path}:{number}"
        step, layer, rank = (_int_field(value, k, where) for k in ("step", "layer", "rank"))
        tokens, topk = _int_field(value, "num_tokens", where), _int_field(value, "topk", where)
        block = value.get("block")
        if not isinstance(block, str):
            raise ValueError(f"{where}: 'block' must be a string, got {block!r}")
        mtp_idx = value.get("mtp_idx")
        if mtp_idx is not None and (isinstance(mtp_idx, bool) or not isinstance(mtp_idx, int)):
            raise ValueError(f"{where}: 'mtp_idx' must be an int, got {mtp_idx!r}")
        rows = value.get("top_indices")
        if not isinstance(rows, list) or len(rows) != tokens:
            got = len(rows) if isinstance(rows, list) else type(rows).__name__
            raise ValueError(f"{where}: 'top_indices' must be a list of num_tokens={tokens} rows, got {got}")
        ids = np.zeros((tokens, topk), dtype=np.int64)
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != topk:
                raise ValueError(f"{where}: top_indices row {i} must hold topk={topk} ids, got {row!r}")
            for e in row:
                if isinstance(e, bool) or not isinstance(e, int) or e < 0:
                    raise ValueError(f"{where}: top_indices row {i}: expert id {e!r} is not an int >= 0")
            ids[i] = row
        records.append(TraceRecord(step, block, layer, rank, mtp_idx, ids))
    return records


def trace_expert_load(records: list[TraceRecord], num_experts: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """Tokens per expert for each `(step, layer)` of the decoder's records, summed over the records' ranks.

    Raises:
        ValueError: When an id is not below `num_experts`.
    """
    out: dict[tuple[int, int], np.ndarray] = {}
    for r in records:
        if r.block != "decoder":
            continue
        if r.top_indices.size and int(r.top_indices.max()) >= num_experts:
            raise ValueError(
                f"step {r.step} layer {r.layer} rank {r.rank}: expert id {int(r.top_indices.max())} "
                f"is not below num_experts={num_experts}"
            )
        counts = np.bincount(r.top_indices.reshape(-1), minlength=num_experts)
        key = (r.step, r.layer)
        out[key] = out[key] + counts if key in out else counts
    return {key: tuple(int(n) for n in counts) for key, counts in sorted(out.items())}
