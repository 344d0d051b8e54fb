"""The framework examples run as a reader runs them: SkyRL's in `.venv-frameworks`, verl's in `.venv-verl`.

`examples/skyrl_swap.py` imports SkyRL the way a SkyRL user's trainer does
(`from skyrl.train.dataset import preprocess`). SkyRL 0.4.0's package
`__init__`s need Python 3.12 and `datasets`, so here (3.11, `--no-deps`) the
script runs after `frameworks.load_skyrl_worker` has registered the bare parent
packages and loaded SkyRL's Megatron model wrapper (so that `install()` swaps
both sides, as in a worker process); the script itself is unchanged. Its stated output (the comment lines at its end)
must be what it prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integrations.frameworks import requires, requires_full_verl, requires_skyrl_worker

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def stated_output(path: Path) -> list[str]:
    lines = path.read_text().rstrip().splitlines()
    tail = []
    while lines and lines[-1].startswith("# "):
        tail.append(lines.pop()[2:])
    return tail[::-1]


@requires("skyrl")
@requires_skyrl_worker()
def test_skyrl_swap_example_prints_what_it_states():
    script = ROOT / "examples" / "skyrl_swap.py"
    runner = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import frameworks; "
        "frameworks.load('skyrl', 'skyrl.train.dataset.preprocess'); "
        "frameworks.load_skyrl_worker('skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper'); "
        "runpy.run_path(sys.argv[2], run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", runner, str(HERE), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == stated_output(script)


@requires_full_verl()
def test_verl_swap_example_prints_what_it_states():
    """`examples/verl_swap.py` needs verl installed as its guide says (with its dependencies): run as is."""
    script = ROOT / "examples" / "verl_swap.py"
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == stated_output(script)
