"""The torch-r3 command line: doctor, help, python -m torch_r3 (bench's options are tested in test_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from torch_r3 import cli


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

