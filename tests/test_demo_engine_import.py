"""`torch-r3 demo --engine vllm` where `vllm` is found but does not import (issue 43, item 12).

A source checkout named `vllm` in the working directory (its compiled extension never
built), or a folder of that name without `LLM`, passes a `find_spec` check; the demo must
still stop with its own error, exit status 2, naming the import error, before it builds a
model. Each case is a real package folder on the path of a real `torch-r3` process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BROKEN = {
    # a source checkout: the package imports its compiled extension, which was never built
    "checkout": ("from ._C import ops  # noqa: F401\n", "No module named 'vllm._C'"),
    # a broken install: the import itself fails on something else than a missing module
    "broken": ("raise RuntimeError('libcudart.so.12: cannot open shared object file')\n", "libcudart.so.12"),
    # a folder of that name without the engine's API (imports as a namespace package)
    "namespace": (None, "cannot import name 'LLM'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_demo_engine_vllm_names_the_import_error_and_exits_2(tmp_path, case):
    init, expected = BROKEN[case]
    package = tmp_path / "vllm"
    package.mkdir()
    if init is not None:
        (package / "__init__.py").write_text(init)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from torch_r3.cli import main; sys.exit(main())",
            "demo",
            "--engine",
            "vllm",
            "--quiet",
        ],
        cwd=tmp_path,  # where `python` looks first, as for a checkout in the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "--engine vllm" in done.stderr and expected in done.stderr, done.stderr[-3000:]
    assert str(package) in done.stderr, "the message says which vllm was found"
