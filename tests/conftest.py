"""Fixtures shared by several test modules."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_finish(session) -> None:
    """Move what collection built (torch, Megatron, transformers, Hypothesis strategies: millions of
    long-lived objects) out of the garbage collector's reach. Every full collection afterwards, the
    interpreter's own and the explicit ones (the benchmark collects before each strategy it times),
    walks only what the tests themselves create. Collected first, so none of it is garbage; frozen
    objects are not freed until the session ends (`pytest_unconfigure`)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    """Hand the frozen objects back before the interpreter exits, so that its last collection frees
    them as it did before (extension modules otherwise report them as leaked at exit)."""
    gc.unfreeze()


try:  # the test extra installs Hypothesis; a run without it skips the property tests, not the suite
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:
    # Every property test in any environment: no per-example deadline and no "generation too slow"
    # check, so a loaded machine slows a run down without failing it. A test's own @settings
    # (its example count) still applies on top of this profile.
    settings.register_profile("torch_r3", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("torch_r3")


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The mkdocs site built once per session (the render checks and the API-surface checks both read it)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install 'torch_r3[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(out), "--config-file", str(ROOT / "mkdocs.yml")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    return out


@dataclass(frozen=True)
class DemoRun:
    """One `torch-r3 demo` run: what it printed and the figures its `--json` wrote."""

    returncode: int
    stdout: str
    stderr: str
    figures: dict[str, Any]
    run_log: Path | None = None  # where `--run-log` wrote, when it was given


def run_demo(workdir: Path, *args: str, block: tuple[str, ...] = (), timeout: float = 900) -> DemoRun:
    """`torch-r3 demo --quiet --json PATH *args` in `workdir` (outside the source tree), in a
    fresh interpreter where the `block`ed top-level modules cannot be imported."""
    path = workdir / "figures.json"
    code = (
        "import sys\n"
        f"for name in {list(block)!r}:\n    sys.modules[name] = None\n"
        "from torch_r3.cli import main\n"
        f"sys.exit(main(['demo', '--quiet', '--json', {str(path)!r}, *{list(args)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=workdir, env=env, check=False
    )
    figures = json.loads(path.read_text()) if done.returncode == 0 else {}
    run_log = workdir / args[args.index("--run-log") + 1] if "--run-log" in args else None
    return DemoRun(done.returncode, done.stdout, done.stderr, figures, run_log)


@pytest.fixture(scope="session")
def megatron_demo(tmp_path_factory) -> DemoRun:
    """The default demo (Megatron trainer, seed 0), run once per session: the end-to-end
    tests, the tutorial's figure checks and the report's (from the run log it also writes,
    after its output) read the same run."""
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    run = run_demo(tmp_path_factory.mktemp("megatron-demo"), "--run-log", "run.jsonl")
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.fixture(scope="session")
def transformers_demo(tmp_path_factory) -> DemoRun:
    """`--trainer transformers` (seed 0) once per session, in a process where Megatron cannot
    be imported: a transformers-only user's run."""
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    run = run_demo(tmp_path_factory.mktemp("transformers-demo"), "--trainer", "transformers", block=("megatron",))
    assert run.returncode == 0, run.stderr[-4000:]
    return run
