"""`torch-r3 demo --dsa`: the sparse-attention variant runs end to end on the loopback server, and replaying
the indexer selections with the routes cuts the log-prob gap further than the routes alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from torch_r3.cli import main as cli_main
from torch_r3.demo.dsa import DSA_RUNS, DSAConfig, format_dsa_report, run_dsa

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "sparse-attention.md"


def test_the_variant_rolls_out_with_selections_and_replay_cuts_the_gap():
    cfg = DSAConfig(trajectories=2, turns=2)
    results = run_dsa(cfg, quiet=True)
    sizes = results["sizes"]
    # Every evaluated position has a selection row, in every trajectory (SGLang's rows: seqlen - 1).
    assert sizes["selection_rows"] == cfg.trajectories * (cfg.seq_len - 1)
    assert sizes["selection_bytes"] < sizes["selection_dense_bytes"]
    gaps = {run: results[run]["logprob_abs_diff"] for run in DSA_RUNS}
    assert gaps["routes_and_selections"] < gaps["without_replay"]
    assert 0 < results["without_replay"]["selection_overlap"] <= 1
    assert f"index_topk={cfg.index_topk}; selections" in format_dsa_report(results)  # the value, not its code


def test_the_cli_flag_prints_the_variant_s_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "dsa.json"
    assert cli_main(["demo", "--dsa", "--quiet", "--trajectories", "1", "--turns", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == [
        "trainer",
        "replays",
        "mean",
        "|dlogp|",
        "max",
        "|dlogp|",
        "gap",
        "cut",
        "indexer",
        "agreement",
    ]
    assert [line.split("  ")[0].strip() for line in table.splitlines()[1:4]] == list(DSA_RUNS.values())
    assert set(json.loads(out.read_text())) == {*DSA_RUNS, "sizes"}
    assert cli_main(["demo", "--dsa", "--server-url", "http://127.0.0.1:1"]) == 2


def test_dsa_refuses_a_run_log_and_its_help_says_so(tmp_path, capsys):
    from torch_r3.demo import build_parser

    text = " ".join(build_parser().format_help().split())
    assert (
        "--run-log PATH append each run's step to a run log (JSON lines; see torch-r3 report); not with --dsa" in text
    )
    assert "--server-url URL use this inference server instead of starting the loopback one (not with --dsa" in text
    assert cli_main(["demo", "--dsa", "--run-log", str(tmp_path / "r.jsonl")]) == 2
    assert "no --run-log" in capsys.readouterr().err and not (tmp_path / "r.jsonl").exists()


_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "eight": 8}


@pytest.mark.slow
def test_the_default_dsa_run_is_the_one_the_guide_describes(tmp_path, capsys):
    words = re.search(r"(\w+) (\d+)-turn rollouts go", " ".join(GUIDE.read_text().split()))
    assert words, "the guide no longer says how many rollouts the variant runs"
    out = tmp_path / "dsa.json"
    assert cli_main(["demo", "--dsa", "--quiet", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert json.loads(out.read_text())["sizes"]["trajectories"] == _WORDS[words[1]] == DSAConfig().trajectories
    assert DSAConfig().turns == int(words[2])
    assert f"({_WORDS[words[1]]} trajectories," in table
