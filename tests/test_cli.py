"""The torch-r3 command line: bench options on tiny shapes, doctor, the shared conventions, python -m torch_r3."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import torch_r3
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


def _default_threads() -> int:
    """What torch picks on a machine with no quota: never more threads than usable CPUs."""
    import torch

    from torch_r3.cpu import usable_cpus

    return min(torch.get_num_threads(), max(1, math.floor(usable_cpus())))


@pytest.fixture
def torch_threads():
    """Set torch's intra-op thread count for one test, then restore it."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_doctor_reports_the_installed_versions(monkeypatch, tmp_path, capsys):
    import torch

    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    versions = json.loads(path.read_text())["versions"]
    for name in ("torch_r3", "torch", "numpy", "megatron-core", "aiohttp"):
        try:
            expected = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = None
        assert versions[name] == expected, name
    assert versions["torch"] == torch.__version__ and versions["torch_r3"] == torch_r3.__version__
    out = capsys.readouterr().out
    assert f"torch                {torch.__version__}" in out
    assert f"torch_r3             {torch_r3.__version__}" in out


def test_doctor_reports_accelerator_and_pinned_memory(tmp_path, capsys):
    import torch

    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    accelerator = json.loads(path.read_text())["accelerator"]
    assert accelerator["available"] == torch.accelerator.is_available()
    assert accelerator["cuda_build"] == torch.version.cuda
    if not accelerator["available"]:
        assert accelerator["pinned_memory"] is False
    out = capsys.readouterr().out
    for line in ("accelerator", "available", "torch built with", "pinned memory", "affinity mask", "usable CPUs",
                 "pool workers", "torch threads"):
        assert line in out, line


def test_doctor_gives_no_warning_on_a_default_set_up(monkeypatch, torch_threads, capsys):
    monkeypatch.delenv("TORCH_R3_NUM_WORKERS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch_threads(_default_threads())
    report = cli.doctor_report()
    assert report["warnings"] == []
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "ok: nothing to fix" in out


def test_doctor_warns_when_torch_threads_exceed_the_usable_cpus(monkeypatch, torch_threads):
    from torch_r3.cpu import usable_cpus

    monkeypatch.delenv("TORCH_R3_NUM_WORKERS", raising=False)
    fit = max(1, math.floor(usable_cpus()))
    torch_threads(fit + 1)
    (warning,) = cli.doctor_report()["warnings"]
    assert f"{fit + 1} intra-op threads" in warning and f"OMP_NUM_THREADS={fit}" in warning


@pytest.mark.parametrize("value", ["too_many", "abc"])
def test_doctor_warns_about_a_worker_override_it_cannot_honour(monkeypatch, torch_threads, value, capsys):
    from torch_r3.cpu import usable_cpus

    torch_threads(_default_threads())
    env = str(math.floor(usable_cpus()) + 1) if value == "too_many" else value
    monkeypatch.setenv("TORCH_R3_NUM_WORKERS", env)
    (warning,) = cli.doctor_report()["warnings"]
    assert "TORCH_R3_NUM_WORKERS" in warning and env in warning
    assert cli.main(["doctor"]) == 0
    assert f"(from TORCH_R3_NUM_WORKERS={env})" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_json_takes_a_path_in_every_subcommand(command):
    _parser, subparsers = cli._parser(command)
    (action,) = [a for a in subparsers[command]._actions if "--json" in a.option_strings]
    assert action.nargs is None and action.metavar == "PATH"  # one value, a path: not a flag


def test_doctor_json_goes_to_the_file_report_to_stdout_status_to_stderr(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(path.read_text())) == {"versions", "accelerator", "cpu", "warnings"}
    assert captured.out.startswith("versions\n") and "{" not in captured.out
    assert captured.err == f"torch-r3 doctor: wrote {path}\n"


def test_bare_torch_r3_prints_the_same_help_as_dash_dash_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    assert cli.main([]) == e.value.code == 0
    assert capsys.readouterr().out == help_text
    assert all(name in help_text for name in cli.COMMANDS)


def test_demo_without_megatron_names_the_extra_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import megatron.core now fails
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err == "torch-r3 demo: megatron-core is not installed; the demo needs pip install 'torch_r3[megatron,client]'\n"


def test_python_dash_m_torch_r3_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "torch_r3", "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usable CPUs" in done.stdout


def test_benchmarks_script_uses_the_same_engine():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "collate_bench.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--preset" in done.stdout and "--mixed-dtypes" in done.stdout
