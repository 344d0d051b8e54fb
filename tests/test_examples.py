"""Every script in `examples/` runs as a reader runs it, and says what it claims.

Examples are discovered, not listed: a new `examples/*.py` is run here, in a
subprocess (`python examples/<name>.py`, the worktree first on the path), unless
another test already runs it (a test file that names it, e.g.
`test_client_e2e.py` for `server_rollout.py`, `test_ray.py` for
`ray_cluster.py`), so no example runs twice in a suite. Every example runs on
the CPU; one that needs a GPU belongs in `tests/gpu/`.

`examples/rl_step.py` is also checked on its printed figures, each against a
measurement the example did not take the same way: replayed routes agree with
the rollout on every captured token, the hook's own drift figure matches the
agreement measured without the hook, and replay narrows the log-prob gap.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
HANG_GUARD_S = 600  # a stuck server or worker fails the test instead of the suite; not a speed target


def imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """`(module, names)` for every import statement of a script (`names` empty for `import x`)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def run_by_other_tests(example: Path) -> list[str]:
    """The test files, other than this one, that name the example's file."""
    here = Path(__file__).resolve()
    return [
        str(t.relative_to(ROOT))
        for t in sorted((ROOT / "tests").rglob("test_*.py"))
        if t.resolve() != here and example.name in t.read_text()
    ]


RUN_HERE = [e for e in EXAMPLES if not run_by_other_tests(e)]


@functools.cache
def run_example(name: str) -> subprocess.CompletedProcess[str]:
    """Run `examples/<name>` once per session; every check of its output reads this run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_every_example_is_run_by_a_test_and_only_once():
    assert EXAMPLES, "no examples/*.py found"
    assert (ROOT / "examples" / "rl_step.py") in RUN_HERE  # this file's own subject
    for example in EXAMPLES:
        assert example in RUN_HERE or run_by_other_tests(example), example.name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_import_only_public_names(example):
    for module, names in imported_modules(example):
        if not module.startswith("torch_r3"):
            continue
        assert not any(part.startswith("_") for part in module.split(".")), f"{example.name}: imports {module}"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{example.name}: imports {private} from {module}"
        try:
            public = getattr(importlib.import_module(module), "__all__", None)
        except ImportError:  # its extra is not installed; the name checks above still ran
            continue
        outside = [n for n in names if public is None or n not in public]
        assert not outside, f"{example.name}: {outside} are not in {module}.__all__"


@pytest.mark.slow  # a subprocess with its own server thread and DataLoader workers
@pytest.mark.parametrize("example", RUN_HERE, ids=lambda p: p.name)
def test_example_runs_cleanly(example):
    missing = sorted(
        {m.split(".")[0] for m, _ in imported_modules(example) if importlib.util.find_spec(m.split(".")[0]) is None}
    )
    if missing:
        pytest.skip(f"{example.name} needs {missing}, not installed")
    result = run_example(example.name)
    assert result.returncode == 0, f"{example.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    # A warning in an example is a defect every reader copies.
    assert "Warning" not in result.stderr, result.stderr


def rl_step_figures() -> dict:
    pytest.importorskip("transformers")
    result = run_example("rl_step.py")
    assert result.returncode == 0, result.stderr
    out = result.stdout

    def pair(label: str, unit: str = "") -> tuple[float, float]:
        m = re.search(rf"^{re.escape(label)}\s+([\d.]+){unit}\s+([\d.]+){unit}$", out, re.M)
        assert m, f"no {label!r} line in:\n{out}"
        return float(m[1]), float(m[2])

    m_tokens = re.search(r"TokenCounts\(captured=(\d+), live=(\d+), filler=(\d+), padding=(\d+)\)", out)
    m_drift = re.search(r"route drift per layer: (.*)$", out, re.M)
    m_grad = re.search(r"router gradient norm (\S+)$", out, re.M)
    m_traj = re.search(r"^(\d+) trajectories", out, re.M)
    assert m_tokens and m_drift and m_grad and m_traj, out
    layers = [tuple(map(float, m)) for m in re.findall(r"^  layer \d+\s+([\d.]+)%\s+([\d.]+)%$", out, re.M)]
    return {
        "agreement": pair("route agreement on captured tokens", "%"),
        "layers": layers,
        "gap": pair("mean |logp_train - logp_rollout|"),
        "drift": [float(d.rstrip("%")) for d in m_drift[1].split()],
        "tokens": tuple(map(int, m_tokens.groups())),
        "router_grad": float(m_grad[1]),
        "trajectories": int(m_traj[1]),
    }


@pytest.mark.slow
def test_rl_step_replay_agrees_on_every_captured_token_and_without_it_some_routes_flip():
    f = rl_step_figures()
    assert len(f["layers"]) == len(f["drift"]) > 0
    with_replay, without = f["agreement"]
    assert with_replay == 100.0 and all(w == 100.0 for w, _ in f["layers"])
    # bf16 inference against fp32 training: if no route flipped, the example would show nothing.
    assert without < 100.0
    assert min(wo for _, wo in f["layers"]) < 100.0


@pytest.mark.slow
def test_rl_step_hook_drift_matches_the_agreement_measured_without_the_hook():
    # Layer 0 sees the same inputs with and without replay (replay changes what later layers see),
    # so the hook's drift there is exactly the disagreement the un-hooked run measured by its own spy.
    f = rl_step_figures()
    _, without_layer0 = f["layers"][0]
    assert f["drift"][0] == pytest.approx(100.0 - without_layer0, abs=0.011)  # both printed to 0.01%
    assert all(0.0 <= d <= 100.0 for d in f["drift"])


@pytest.mark.slow
def test_rl_step_replay_narrows_the_logprob_gap_and_trains_the_router():
    f = rl_step_figures()
    gap_with, gap_without = f["gap"]
    assert 0.0 < gap_with < gap_without  # bf16 rounding remains; the flipped experts' share is gone
    captured, live, filler, _padding = f["tokens"]  # padding: tests/transformers/test_hf_hook_metrics.py
    # One uncaptured position per trajectory: its last token, which the engine never ran forward.
    assert captured > 0 and live == f["trajectories"] and filler == 0
    assert f["router_grad"] > 0.0
