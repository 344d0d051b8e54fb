"""`torch-r3 demo --dsa`: the sparse-attention variant runs end to end on the loopback server, and replaying
the indexer selections with the routes cuts the log-prob gap further than the routes alone."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from torch_r3.cli import main as cli_main
from torch_r3.demo.dsa import DSA_RUNS, DSAConfig, run_dsa


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
