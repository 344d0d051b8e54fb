"""The monitoring page's logger snippets, run as the page writes them, and its claim about collation.

The blocks are read from docs/guides/monitoring.md (the parser of tests/test_docs_snippets.py),
so the page and this test cannot drift: the page's `ReplayStats` block, the block that builds
the scalars every logger gets, and one block per logger (TensorBoard, W&B, MLflow), each
guarded by `importlib.util.find_spec`.

* The scalars are checked against `ReplayStats`' own fields (drift per layer, token counts,
  the live share) and the expert-load figures computed here from its per-expert counts;
  every name is one the page's metric table documents.
* For each logger that is installed, a fresh interpreter runs the page's blocks and then
  reads back what the logger stored on disk (TensorBoard's event file, MLflow's file store,
  the W&B offline run's record log); those values must be the scalars, at the page's step.
  Where a logger is not installed its test skips and names the package.
* Expert load cannot move collation: collating a batch never imports `torch_r3.replay`,
  where the counts live.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.test_docs_snippets import Block, parse

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "monitoring.md"
LOGGER_HEADING = "## Sending them to a logger"
LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # find_spec name -> pip package


def _section_lines(text: str, heading: str) -> range:
    lines = text.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return range(start + 1, end + 1)  # 1-based lines of the section's body


def page_blocks() -> dict[str, Block]:
    """The page's blocks this test runs: `stats`, `scalars`, and one per logger, by name."""
    text = PAGE.read_text()
    blocks = parse(text, "docs/guides/monitoring.md")
    section = _section_lines(text, LOGGER_HEADING)
    out: dict[str, Block] = {}
    for block in blocks:
        if "stats = ReplayStats(" in block.code:
            out.setdefault("stats", block)
        elif block.line in section:
            if "scalars = " in block.code:
                out["scalars"] = block
            for name in LOGGERS:
                if f'find_spec("{name}")' in block.code:
                    assert name not in out, f"two blocks for {name} on the page"
                    out[name] = block
    missing = {"stats", "scalars", *LOGGERS} - set(out)
    assert not missing, f"docs/guides/monitoring.md no longer has the block(s) {sorted(missing)}"
    return out


def _run_in_process(*blocks: Block) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__page__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for block in blocks:
            exec(compile(block.code, f"monitoring.md:{block.line}", "exec"), namespace)
    return namespace


def expected_scalars(stats: Any) -> dict[str, float]:
    """What a logger should get for `stats`, from its fields (not from `as_dict`)."""
    drift = {layer: d for layer, d in stats.route_drift.items()}
    measured = [d for d in drift.values() if d is not None]
    out = {f"r3/route_drift/layer_{layer}": math.nan if d is None else d for layer, d in drift.items()}
    out["r3/route_drift/mean"] = sum(measured) / len(measured)
    out["r3/live_fraction"] = stats.live_fraction
    out["r3/tokens/captured"] = stats.tokens.captured
    out["r3/tokens/live"] = stats.tokens.live
    out["r3/tokens/filler"] = stats.tokens.filler
    out["r3/tokens/padding"] = stats.tokens.padding
    if stats.dropped_fraction is not None:
        out["r3/dropped_fraction"] = stats.dropped_fraction
    for source, loads in (("rollout", stats.rollout_load), ("trainer", stats.trainer_load)):
        for layer, load in (loads or {}).items():
            share = [n / sum(load) for n in load]
            out[f"r3/expert_load/{source}/max_over_mean/layer_{layer}"] = max(share) * len(load)
            entropy = -sum(p * math.log(p) for p in share if p > 0)
            out[f"r3/expert_load/{source}/entropy/layer_{layer}"] = entropy / math.log(len(load))
    return out


def documented_names() -> list[re.Pattern[str]]:
    """The metric table's names as patterns (`<l>` a layer, `...` any tail)."""
    text = PAGE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    patterns = []
    for row in rows:
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            regex = re.escape(name).replace(re.escape("<l>"), r"\d+").replace(re.escape("..."), r".+")
            patterns.append(re.compile(regex + "$"))
    return patterns


def test_the_scalars_the_loggers_get_are_replay_stats_own_figures():
    blocks = page_blocks()
    ns = _run_in_process(blocks["stats"], blocks["scalars"])
    stats, scalars = ns["stats"], ns["scalars"]
    want = expected_scalars(stats)
    assert set(scalars) == set(want)
    assert all(scalars[k] == pytest.approx(v, rel=1e-12) for k, v in want.items()), (scalars, want)
    # the figures the page's first block prints, and a hand count: layer 1's trainer load is
    # (150, 10, 10, 22): 150 tokens of 192 over 4 experts, 3.125 times the mean
    assert scalars["r3/expert_load/trainer/max_over_mean/layer_1"] == 150 / (192 / 4)
    assert scalars["r3/route_drift/mean"] == pytest.approx((0.02 + 0.05) / 2)
    patterns = documented_names()
    undocumented = [k for k in scalars if not any(p.match(k.removeprefix("r3/")) for p in patterns)]
    assert undocumented == [], "the metric table on the page does not name these"


def test_every_logger_block_is_guarded_and_logs_the_scalars_at_the_step():
    # What runs where no logger is installed: each block's calls sit under its find_spec guard.
    for name, block in page_blocks().items():
        if name in LOGGERS:
            first = next(line for line in block.code.splitlines() if line.strip() and not line.startswith("import "))
            assert first.startswith(f'if importlib.util.find_spec("{name}"):'), (name, first)
            assert "scalars" in block.code and "step" in block.code, name


# Run after the page's blocks, in the same namespace: what each logger stored, read back from disk.
READ_BACK = {
    "tensorboard": """
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(f"{logdir}/tensorboard", size_guidance={"scalars": 0})
        acc.Reload()
        stored = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    """,
    "mlflow": """
        client = mlflow.tracking.MlflowClient()
        run_id = mlflow.last_active_run().info.run_id
        stored = {
            key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
            for key in client.get_run(run_id).data.metrics
        }
    """,
    "wandb": """
        import glob, struct
        from wandb.proto import wandb_internal_pb2

        def records(path):
            # The offline run's record log: a 7-byte header, then 32 KiB blocks of records, each
            # a 7-byte header (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes.
            data = open(path, "rb").read()
            assert data[:4] == b":W&B", data[:7]
            pos, part = 7, b""
            while pos + 7 <= len(data):
                room = 32768 - pos % 32768
                if room < 7:
                    pos += room
                    continue
                _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
                part += data[pos + 7 : pos + 7 + length]
                pos += 7 + length
                if kind in (1, 4):
                    record = wandb_internal_pb2.Record()
                    record.ParseFromString(part)
                    part = b""
                    yield record

        (path,) = glob.glob(f"{logdir}/wandb/offline-run-*/run-*.wandb")
        stored = {}
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_"):
                        stored.setdefault(key, []).append((row["_step"], value))
    """,
}


@pytest.mark.slow
@pytest.mark.parametrize("logger", list(LOGGERS))
def test_each_installed_logger_stores_the_scalars_the_page_sends(logger, tmp_path):
    if importlib.util.find_spec(logger) is None:
        pytest.skip(f"{logger} is not installed (pip install {LOGGERS[logger]}): the page's {logger} calls did not run")
    blocks = page_blocks()
    code = "\n".join(blocks[name].code for name in ("stats", "scalars", logger))
    out = tmp_path / "stored.json"
    code += "import json\n" + textwrap.dedent(READ_BACK[logger])
    code += f"json.dump({{'step': step, 'stored': stored}}, open({str(out)!r}, 'w'))\n"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TMPDIR": str(tmp_path),  # the page's mkdtemp() lands here
        "WANDB_SILENT": "true",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    want = expected_scalars(_run_in_process(blocks["stats"])["stats"])
    stored = result["stored"]
    assert set(stored) == set(want)
    for key, value in want.items():
        ((step, got),) = stored[key]  # one value per name, at the page's step
        assert step == result["step"] == 10
        assert got == pytest.approx(value, rel=1e-6), key  # TensorBoard stores float32


def test_collating_a_batch_never_loads_the_code_that_counts_expert_load():
    # The monitoring page says collation is unchanged by expert load: the counts live in
    # torch_r3.replay (the hooks), which no collator imports.
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import torch_r3
        from torch_r3 import R3Collator, ShardCollator

        rng = np.random.default_rng(0)
        samples = [
            {"input_ids": list(range(1, 9)), "routes": np.argsort(rng.random((7, 2, 8)), -1)[..., :2].astype(np.uint8)}
            for _ in range(2)
        ]
        batch = R3Collator(pad_token_id=0)(samples)
        assert batch["rollout_expert_indices"].shape == (2, 8, 2, 2)
        print(sorted(m for m in sys.modules if m.startswith("torch_r3.replay")))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]"
