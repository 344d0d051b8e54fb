"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
