"""`make test` changes nothing outside the repository: every command it would run, read from
`make --dry-run`, installs only into the repository's own virtualenvs; the headless browser is
one already on the machine, and without one the browser tests skip, saying why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser import BROWSERS, MISSING

ROOT = Path(__file__).resolve().parent.parent
VENVS = (".venv/bin/", ".venv-megatron-0.19/bin/", ".venv-frameworks/bin/", ".venv-verl/bin/", ".venv-vllm/bin/")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_make_test_would_install_nothing_outside_the_repository():
    # -B: every target out of date, so the setup recipes are listed too; -n: listed, not run
    dry = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "pytest" in dry and "mkdocs build" in dry  # the real recipe was read
    for word in ("apt-get", "apt ", "dpkg", "sudo", "snap ", "brew ", "playwright install"):
        assert word not in dry, f"make test would run {word.strip()!r}"
    installs = [line for line in dry.splitlines() if re.search(r"\bpip\b.* install", line)]
    assert installs
    for line in installs:
        assert line.lstrip().startswith(VENVS), f"a pip install outside the repository's virtualenvs: {line}"


def test_without_a_browser_on_path_the_check_says_why_and_the_tests_skip(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # an empty directory: no browser, nothing else
    done = subprocess.run(
        [sys.executable, "-m", "tests.browser"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert done.stdout.strip() == f"headless-browser tests: {MISSING}"
    assert all(name in MISSING for name in BROWSERS) and "skip" in MISSING
    reason = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "tests/test_runlog_report.py",
            "-k",
            "browser",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env={**env, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert reason.returncode == 0, reason.stdout[-2000:]
    assert "SKIPPED" in reason.stdout and "no headless browser on PATH" in reason.stdout
