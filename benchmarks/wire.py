"""Routes off the wire: one response body to compact routes, today's path against the new one.

For SGLang `/generate` bodies (base64 of raw int32 in `meta_info`) and vLLM
bodies (base64 of a `.npy`, uint8 up to 256 experts, else uint16) of
DeepSeek-V3-shaped (61 layers, 256 experts, top-8) and Kimi-K2-shaped (61 layers,
384 experts, top-8) trajectories, it times, in interleaved rounds on the same bodies:

- memcpy: a warm copy of the body's bytes into a buffer that already exists (the physical floor);
- simd decode: `pybase64.b64decode` of the route text alone;
- simd + narrow: that, then NumPy's cast of the decoded array to the canonical dtype (the target's floor);
- today: `json.loads(body)`, then the codec's reference decoder (`TORCH_R3_BASE64=reference`,
  the decoder of torch_r3 0.1: chunked binascii, then `compact_routes`);
- parse_body: the new path's first step alone: the route text located in place, the rest
  parsed as JSON (this part holds the GIL; the decode after it mostly does not);
- new: `parse_body(body)` then the codec's kernel (pybase64);
- fallback: the same, with the strict binascii decoder (`TORCH_R3_BASE64=binascii`).

Small bodies, the answers of short turns (64 prompt + 32 generated tokens of a
4-layer, top-4 of 16 experts model, as `engine_bench.py` serves it: a 5.9 kB
vLLM-OpenAI completions body with log-probs, and SGLang's `/generate` body of
the same turn), are timed apart: the client's whole read of one (`parse_body`
and the protocol's `parse_response`: ids, log-probs, routes checked and
compacted) against `json.loads` of the same body, interleaved, many calls per
sample, with the ratio of each pair.

Every path's routes are checked bit-identical to today's before any timing
counts. Then 1, 2 and 4 responses in flight (separate bodies, decoded through
the client's decode pool) for the largest SGLang body, and the peak memory each
path adds on top of the body (tracemalloc, in a separate untimed pass).

Usage: PYTHONPATH=. python benchmarks/wire.py [--rounds 5] [--tokens 4096 32768] [--json out.json]
About 60 s on 2 cores with the defaults; needs about 2 GiB of memory. On a busy
machine it says so: compare figures within one round, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from torch_r3.bench.trust import BUSY_LOAD_PER_CPU, SPREAD_LIMIT
from torch_r3.cpu import loadavg_1min, usable_cpus
from torch_r3.rollout import _base64, _json, _offload, codec
from torch_r3.rollout.protocols import PROTOCOLS, GenerateCall, ParsedResponse, RouteLimits
from torch_r3.rollout.protocols.spans import parse_body

MODELS = {"DeepSeek-V3": (61, 256, 8), "Kimi-K2": (61, 384, 8)}
PATHS = ("memcpy", "simd decode", "simd + narrow", "today", "parse_body", "new", "fallback")


@dataclass
class Case:
    """One response body and what decoding it must give."""

    label: str
    server: str
    body: bytearray
    text: Any  # the route text, as a view of the body
    wire: np.dtype
    layers: int
    topk: int
    routes: np.ndarray  # the canonical routes, from today's path


@dataclass
class SmallCase:
    """One short turn's answer and what the client must read from it."""

    label: str
    server: str
    body: bytearray
    call: GenerateCall
    limits: RouteLimits
    routes: np.ndarray


# The turn `engine_bench.py` serves: 64 prompt + 32 generated tokens of a 4-layer, top-4 of 16 experts model.
SMALL_TURN = {"prompt": 64, "generated": 32, "layers": 4, "topk": 4, "experts": 16}
SMALL_CALLS = 200  # calls per timed sample: a sample of one call would be mostly the clock


def _openai_body(routes: np.ndarray, prompt: list[int], ids: list[int], rng: np.random.Generator) -> bytes:
    """A vLLM `/v1/completions` answer with `logprobs=1`, as vLLM 0.33 writes it."""
    pieces = [f" tok{t:03d}" for t in ids]
    logprobs = [round(-float(x), 6) for x in rng.random(len(ids))]
    # With sampling, the most likely token is often another one: vLLM then lists both.
    tops = [{p: lp, f" tok{(t + 1) % 158:03d}": round(lp / 2, 6)} for p, lp, t in zip(pieces, logprobs, ids)]
    offsets = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
    choice = {
        "index": 0,
        "text": "".join(pieces),
        "logprobs": {
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": pieces,
            "top_logprobs": tops,
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt,
        "routed_experts": base64.b64encode(_npy_bytes(routes.astype(np.uint8))).decode(),
        "weight_versions": [{"version": "policy-7", "start": 0, "end": len(ids)}],
    }
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids)}
    return json.dumps(
        {
            "id": "cmpl-969c4a5724dad818",
            "object": "text_completion",
            "created": 1796159342,
            "model": "tiny-qwen3-moe",
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage | {"prompt_tokens_details": None, "completion_tokens_details": None},
            "kv_transfer_params": None,
        }
    ).encode()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def small_cases(seed: int) -> list[SmallCase]:
    """The short turn's answer as vLLM-OpenAI and as SGLang send it."""
    rng = np.random.default_rng(seed)
    turn = SMALL_TURN
    prompt, generated = turn["prompt"], turn["generated"]
    rows = prompt + generated - 1
    routes = np.argsort(rng.random((rows, turn["layers"], turn["experts"])), axis=-1)[..., : turn["topk"]]
    routes = routes.astype(np.uint8)
    prompt_ids = rng.integers(0, 158, prompt).tolist()
    limits = RouteLimits(1 << 30, turn["layers"], turn["topk"], turn["experts"])
    cases = []
    for server in ("vllm-openai", "sglang"):
        if server == "sglang":
            body = _sglang_body(routes, prompt, rng)
            ids = json.loads(body)["output_ids"]
        else:
            ids = rng.integers(0, 158, generated).tolist()
            body = _openai_body(routes, prompt_ids, ids, rng)
        call = GenerateCall(prompt_ids, {}, True)
        label = f"{server} {prompt}+{generated} tokens"
        cases.append(SmallCase(label, server, bytearray(body), call, limits, routes))
    return cases


def client_read(case: SmallCase) -> ParsedResponse:
    """The client's whole read of a body: `parse_body`, then the protocol's `parse_response`."""
    protocol = PROTOCOLS[case.server]
    return protocol.parse_response(parse_body(case.body, protocol.route_text_paths), case.call, case.limits)


def time_small(cases: list[SmallCase], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per body of `json.loads` and of the client's read, `SMALL_CALLS` calls per sample, interleaved."""
    times: dict[str, dict[str, list[float]]] = {c.label: {"json.loads": [], "client": []} for c in cases}
    for case in cases:  # the check: the client reads the routes the body carries
        got = client_read(case).routed_experts
        assert got is not None and got.dtype == case.routes.dtype and np.array_equal(got, case.routes), case.label
    runs = {"json.loads": lambda c: json.loads(c.body), "client": client_read}
    for _ in range(rounds * 5):
        for case in cases:
            for name, fn in runs.items():
                start = time.perf_counter()
                for _ in range(SMALL_CALLS):
                    fn(case)
                times[case.label][name].append((time.perf_counter() - start) / SMALL_CALLS)
    return times


def _sglang_body(routes: np.ndarray, prompt: int, rng: np.random.Generator) -> bytes:
    generated = routes.shape[0] + 1 - prompt
    ids = rng.integers(0, 150_000, generated).tolist()
    meta = {
        "id": "bench",
        "finish_reason": {"type": "length", "length": generated},
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "cached_tokens": 0,
        "output_token_logprobs": [[round(-float(x), 6), t, None] for x, t in zip(rng.random(generated), ids)],
        "routed_experts": base64.b64encode(routes.astype("<i4").tobytes()).decode(),
        "weight_version": "1",
    }
    return json.dumps({"text": "x" * generated, "output_ids": ids, "meta_info": meta}).encode()


def _vllm_body(routes: np.ndarray, prompt: int, experts: int, rng: np.random.Generator) -> bytes:
    generated = routes.shape[0] + 1 - prompt
    ids = rng.integers(0, 150_000, generated).tolist()
    buf = io.BytesIO()
    np.save(buf, routes.astype(np.uint8 if experts <= 256 else np.uint16), allow_pickle=False)
    content = [{"token_id": t, "logprob": round(-float(x), 6)} for x, t in zip(rng.random(generated), ids)]
    choice = {
        "index": 0,
        "token_ids": ids,
        "finish_reason": "length",
        "logprobs": {"content": content},
        "routed_experts": base64.b64encode(buf.getvalue()).decode(),
    }
    usage = {"prompt_tokens": prompt, "completion_tokens": generated}
    return json.dumps({"choices": [choice], "prompt_token_ids": list(range(prompt)), "usage": usage}).encode()


def _decode(case: Case, tree: Any) -> np.ndarray:
    if case.server == "sglang":
        return codec.decode_sglang_routes(tree["meta_info"], num_layers=case.layers, topk=case.topk)
    return codec.decode_vllm_routes(tree["choices"][0]["routed_experts"], num_layers=case.layers, topk=case.topk)


def _with_decoder(name: str, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(_base64.ENV_DECODER)
    os.environ[_base64.ENV_DECODER] = name
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[_base64.ENV_DECODER]
        else:
            os.environ[_base64.ENV_DECODER] = old


def today(case: Case) -> np.ndarray:
    return _with_decoder("reference", lambda: _today(case))


def _today(case: Case) -> np.ndarray:
    return _decode(case, json.loads(case.body))  # under TORCH_R3_BASE64=reference, set by the caller


def new(case: Case) -> np.ndarray:
    return _decode(case, parse_body(case.body, PROTOCOLS[case.server].route_text_paths))


def fallback(case: Case) -> np.ndarray:
    return _with_decoder("binascii", lambda: new(case))


def make_cases(tokens: list[int], seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for n in tokens:
        for model, (layers, experts, topk) in MODELS.items():
            routes = rng.integers(0, experts, (n - 1, layers, topk), dtype=np.int32)
            for server in ("sglang", "vllm"):
                raw = (
                    _sglang_body(routes, n // 4, rng)
                    if server == "sglang"
                    else _vllm_body(routes, n // 4, experts, rng)
                )
                body = bytearray(raw)
                text = parse_body(body, PROTOCOLS[server].route_text_paths)
                text = (
                    text["meta_info"]["routed_experts"] if server == "sglang" else text["choices"][0]["routed_experts"]
                )
                wire = np.dtype("<i4") if server == "sglang" else np.dtype(np.uint8 if experts <= 256 else "<u2")
                case = Case(
                    f"{server} {wire.name} {model} {n // 1024}k", server, body, text, wire, layers, topk, routes
                )
                case.routes = today(case)
                cases.append(case)
    return cases


def floors(case: Case) -> dict[str, Callable[[], Any]]:
    scratch = bytearray(len(case.body))
    target = case.routes.dtype

    def simd_narrow():
        raw = pybase64.b64decode(case.text, validate=True)
        start = len(raw) - case.routes.size * case.wire.itemsize  # past a .npy header
        return np.frombuffer(raw, dtype=case.wire, offset=start).astype(target)

    return {
        "memcpy": lambda: scratch.__setitem__(slice(None), case.body),
        "simd decode": lambda: pybase64.b64decode(case.text, validate=True),
        "simd + narrow": simd_narrow,
    }


def time_rounds(cases: list[Case], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per round of every path on every case, the paths interleaved within each round."""
    times: dict[str, dict[str, list[float]]] = {c.label: {p: [] for p in PATHS} for c in cases}
    runs = {
        c.label: {
            "parse_body": lambda c=c: parse_body(c.body, PROTOCOLS[c.server].route_text_paths),
            **floors(c),
            "today": lambda c=c: today(c),
            "new": lambda c=c: new(c),
            "fallback": lambda c=c: fallback(c),
        }
        for c in cases
    }
    for case in cases:  # warm-up, and the check: every path gives today's routes
        for name in ("new", "fallback"):
            got = runs[case.label][name]()
            assert got.dtype == case.routes.dtype and np.array_equal(got, case.routes), (case.label, name)
        runs[case.label]["simd + narrow"]()
    for _ in range(rounds):
        for case in cases:
            for name in PATHS:
                start = time.perf_counter()
                runs[case.label][name]()
                times[case.label][name].append(time.perf_counter() - start)
    return times


def in_flight(case: Case, counts: tuple[int, ...], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Seconds to decode `n` separate copies of `case`'s body at once, through the client's decode pool."""
    copies = [
        Case(case.label, case.server, bytearray(case.body), None, case.wire, case.layers, case.topk, case.routes)
        for _ in range(max(counts))
    ]

    async def together(fn: Callable[[Case], np.ndarray], n: int) -> float:
        start = time.perf_counter()
        outs = await asyncio.gather(*(_offload.off_loop(len(c.body), fn, c) for c in copies[:n]))
        elapsed = time.perf_counter() - start
        assert all(np.array_equal(o, case.routes) for o in outs)
        return elapsed

    names = ("today", "new", "new, decode alone")
    result: dict[str, dict[int, list[float]]] = {name: {n: [] for n in counts} for name in names}
    trees = [parse_body(c.body, PROTOCOLS[c.server].route_text_paths) for c in copies]
    by_case = {id(c): tree for c, tree in zip(copies, trees)}
    for _ in range(rounds):
        for n in counts:
            # The decoder is chosen by the environment, so it is set once around a batch, not per thread.
            result["today"][n].append(_with_decoder("reference", lambda: asyncio.run(together(_today, n))))  # noqa: B023
            result["new"][n].append(asyncio.run(together(new, n)))
            result["new, decode alone"][n].append(asyncio.run(together(lambda c: _decode(c, by_case[id(c)]), n)))
    return result


def peak_above_body(case: Case) -> dict[str, int]:
    """Peak bytes each path allocates on top of the body it reads (tracemalloc; NumPy reports its buffers)."""
    peaks = {}
    for name, fn in (("today", today), ("new", new), ("fallback", fallback)):
        tracemalloc.start()
        out = fn(case)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del out
    return peaks


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def small_report(cases: list[SmallCase], times: dict[str, dict[str, list[float]]]) -> list[str]:
    """The small-body table: us per body, and the client's read as a multiple of `json.loads`."""
    lines = [
        "",
        f"small bodies -> ids, log-probs and compact routes, us per body (median of samples of {SMALL_CALLS} calls, "
        "interleaved; client/json.loads: the median of each pair's ratio, and its range)",
        f"{'body':<30} {'kB':>6} {'json.loads':>11} {'client':>11} {'client/json.loads':>18} {'range':>13}",
    ]
    for case in cases:
        t = times[case.label]
        ratios = [c / j for c, j in zip(t["client"], t["json.loads"])]
        cells = f"{statistics.median(t['json.loads']) * 1e6:>11.1f} {statistics.median(t['client']) * 1e6:>11.1f}"
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        lines.append(
            f"{case.label:<30} {len(case.body) / 1e3:>6.1f} {cells} {statistics.median(ratios):>17.2f}x {spread:>13}"
        )
    return lines


def report(
    cases: list[Case], times, small, small_times, flight, flight_case: Case, peaks, load_before, load_after, rounds
) -> str:
    usable = usable_cpus()
    lines = [
        f"wire bench  ({rounds} interleaved rounds, medians; pybase64 {pybase64.__version__} ({_base64.describe_decoder()}); "
        f"JSON: {_json.describe_parser()})",
        f"CPU: usable {usable:g}, decode pool {_offload.decode_workers()} threads, load average "
        f"{load_before:.2f} at the start, {load_after:.2f} at the end",
    ]
    busy = []
    if load_before > BUSY_LOAD_PER_CPU * usable:
        busy.append(f"the load average was {load_before:.2f} when the run started, on {usable:g} usable CPUs")
    for case in cases:
        floor = times[case.label]["memcpy"]
        if min(floor) > 0 and max(floor) / min(floor) > SPREAD_LIMIT:
            busy.append(f"the memcpy floor of {case.label} ranged from {_ms(min(floor))} to {_ms(max(floor))} ms")
    lines += [f"WARNING: the machine was busy: {reason}" for reason in busy]
    if busy:
        lines.append(
            "WARNING: the figures below say more about the other work than about decoding; read each round's ratios"
        )
    lines += [
        "",
        "body -> compact routes, ms (median; today/new: how many times faster; new/floor: over simd + narrow)",
    ]
    header = f"{'body':<30} {'MB':>6} " + " ".join(f"{p:>13}" for p in PATHS) + f" {'today/new':>9} {'new/floor':>9}"
    lines.append(header)
    for case in cases:
        t = {p: statistics.median(v) for p, v in times[case.label].items()}
        row = f"{case.label:<30} {len(case.body) / 1e6:>6.1f} " + " ".join(f"{_ms(t[p]):>13}" for p in PATHS)
        lines.append(row + f" {t['today'] / t['new']:>8.1f}x {t['new'] / t['simd + narrow']:>8.2f}x")
    lines += small_report(small, small_times)
    lines += ["", f"per round, {flight_case.label}: today/new and new/floor in each round"]
    one = times[flight_case.label]
    for i in range(rounds):
        lines.append(
            f"  round {i + 1}: memcpy {_ms(one['memcpy'][i])}, simd + narrow {_ms(one['simd + narrow'][i])}, "
            f"today {_ms(one['today'][i])}, parse_body {_ms(one['parse_body'][i])}, new {_ms(one['new'][i])} ms: "
            f"{one['today'][i] / one['new'][i]:.1f}x faster, {one['new'][i] / one['simd + narrow'][i]:.2f}x the floor"
        )
    lines += [
        "",
        f"responses in flight, {flight_case.label} each (separate bodies, the client's decode pool): wall ms, median",
    ]
    for name in flight:
        base = statistics.median(flight[name][1])
        cells = []
        for n, v in flight[name].items():
            m = statistics.median(v)
            cells.append(f"{n} in flight {_ms(m)} ({n * base / m:.2f}x the throughput of one)")
        lines.append(f"  {name:<17} " + "; ".join(cells))
    body = len(flight_case.body)
    out = flight_case.routes.nbytes
    bound = out + 2 * _base64.CHUNK_CHARS + (body - len(flight_case.text))
    lines += [
        "",
        f"peak memory on top of the body ({body / 2**20:.1f} MiB), {flight_case.label} (tracemalloc): "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks.items()),
        f"  bound for new: output {out / 2**20:.1f} MiB + the rest of the body parsed "
        f"({(body - len(flight_case.text)) / 2**20:.2f} MiB and its objects) + one chunk "
        f"({2 * _base64.CHUNK_CHARS / 2**20:.2f} MiB of text and bytes) = {bound / 2**20:.1f} MiB plus the parsed objects",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-round figures here")
    args = parser.parse_args(argv)
    load_before = loadavg_1min() or 0.0
    print("wire bench: building bodies ...", file=sys.stderr)
    cases = make_cases(args.tokens, args.seed)
    print("wire bench: timing ...", file=sys.stderr)
    times = time_rounds(cases, args.rounds)
    small = small_cases(args.seed)
    small_times = time_small(small, args.rounds)
    flight_case = max((c for c in cases if c.server == "sglang"), key=lambda c: len(c.body))
    flight = in_flight(flight_case, tuple(args.in_flight), args.rounds)
    peaks = peak_above_body(flight_case)
    load_after = loadavg_1min() or 0.0
    print(report(cases, times, small, small_times, flight, flight_case, peaks, load_before, load_after, args.rounds))
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "times_s": times,
                    "small_s": small_times,
                    "in_flight_s": {k: {str(n): v for n, v in d.items()} for k, d in flight.items()},
                    "peak_bytes": peaks,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
