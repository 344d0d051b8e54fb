"""The torch-r3 command line: bench options on tiny shapes, doctor, python -m torch_r3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torch_r3 import bench, cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-sequences", "4", "--max-seqlen", "24", "--num-layers", "2", "--topk", "2", "--repeats", "1",
        "--no-progress"]


def test_bench_json_holds_every_strategy_topology_and_targets(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert cli.main(["bench", *TINY, "--json", str(path)]) == 0
    assert "torch_r3 fresh" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    assert [s["name"] for s in data["main"]["strategies"]] == list(bench.STRATEGIES)
    s = data["main"]["strategies"][0]
    for key in ("median_s", "min_s", "max_s", "times_s", "gb_per_s", "speedup_vs_baseline", "ratio_to_memcpy",
                "peak_bytes", "peak_ratio", "checked_against"):
        assert key in s
    assert data["main"]["config"]["num_sequences"] == 4
    assert {"usable_cpus", "pool_workers", "cgroup_cpu_limit", "OMP_NUM_THREADS"} <= set(data["topology"])
    assert [s["name"] for s in data["packed_vs_padded"]["strategies"]] == ["torch_r3 fresh", "torch_r3 packed"]
    assert data["packed_vs_padded"]["config"]["distribution"] == "typical_rl"
    assert data["targets"] and not any(t["applies"] for t in data["targets"])  # not the default shape


def test_bench_plot_writes_a_png_of_the_sweep(tmp_path):
    png = tmp_path / "chart.png"
    args = ["bench", *TINY, "--plot", str(png), "--sweep", "2,4", "--strategies", "baseline,torch_r3 fresh",
            "--no-packed-compare", "--json", str(tmp_path / "r.json")]
    assert cli.main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads((tmp_path / "r.json").read_text())["sweep"]
    assert [p["config"]["num_sequences"] for p in sweep] == [2, 4]


def test_production_preset_states_its_memory_and_refuses_without_it(monkeypatch, capsys):
    monkeypatch.setattr(bench, "available_memory",
                        lambda: {"available": 16 * 2**30, "mem_available": 16 * 2**30, "cgroup_room": None,
                                 "cgroup": None})
    assert cli.main(["bench", "--preset", "production", "--no-progress"]) == cli.EXIT_MEMORY
    err = capsys.readouterr().err
    assert "1024 seqs x max 32768 tokens" in err and "topk 22" in err and "int16" in err
    assert "refused" in err and "only 16.0 GiB is available" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-sequences", "0"], "expected a positive integer"),
        (["--distribution", "zipf"], "invalid choice"),
        (["--strategies", "baseline,fast"], "unknown ['fast']"),
        (["--num-experts", "300", "--dtype", "uint8"], "need int16"),
        (["--sweep", "4"], "--sweep only applies with --plot"),
    ],
)
def test_bad_bench_options_exit_2_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_doctor_prints_the_topology_and_warns_on_oversubscription(monkeypatch, capsys):
    monkeypatch.setenv("TORCH_R3_NUM_WORKERS", "64")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for line in ("affinity mask", "cgroup", "usable CPUs", "pool workers         64 (from TORCH_R3_NUM_WORKERS=64)",
                 "torch threads", "OMP_NUM_THREADS", "pinned memory"):
        assert line in out
    assert "warning: torch threads" in out and "> usable CPUs" in out


def test_doctor_json_is_quiet_when_threads_fit(monkeypatch, capsys):
    import torch

    monkeypatch.setenv("TORCH_R3_NUM_WORKERS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["doctor", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["pool_workers"] == 1 and report["torch_num_threads"] == 1
    assert not any("oversubscribe" in w for w in report["warnings"])


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().out


def test_python_dash_m_torch_r3_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "torch_r3", "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usable CPUs" in done.stdout


def test_benchmarks_script_uses_the_same_engine():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "collate_bench.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--preset" in done.stdout and "--mixed-dtypes" in done.stdout
