"""One RL step with routed-expert replay (R3), end to end, on one machine.

1. A loopback inference server (`torch_r3.testing`) serves a tiny Megatron MoE
   `GPTModel` in **bfloat16**; Megatron's `RouterReplay` in `RECORD` mode
   captures the routes of every position it evaluates.
2. Multi-turn rollouts go through `RemoteGenerateClient`; `RoutedExpertTrace`
   asks only for the rows not captured yet (`routed_experts_prompt_start`).
3. A `DataLoader` with `R3Collator` builds the left-padded batches (in the
   main process by default, as the README recommends; `--num-workers 2` shows
   the worker path).
4. The **same weights in float32** run a training forward/backward through
   Megatron's schedule three times: with `ReplayHook` (tokens without a
   captured route routed live, the default), with `ReplayHook(...,
   uncaptured="replay")` (filler routes there) and without replay.
5. The figures R3 exists to improve are printed side by side: the share of real
   tokens whose training-side experts equal the rollout's, the train-inference
   log-prob mismatch on sampled tokens and on tokens predicted from an
   uncaptured position, and `hook.last_stats` (route drift per layer, live
   fraction, token counts).

Run it with `torch-r3 demo` or `python -m torch_r3.demo [--json PATH]`;
`--trainer transformers` runs the same step with a Hugging Face `transformers`
model on both sides. This module holds what both trainers share (the
configuration, the inference side's sampling, the rollouts, the collation, the
measurements and the report) and the one `run(cfg, trainer=)`; each trainer's
own side is `torch_r3.demo.megatron` or `torch_r3.demo.transformers`, and the
command line (its options, the run log it writes) is `torch_r3.demo.options`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_r3 import R3Collator, RoutedExpertTrace
from torch_r3._checks import check_choice
from torch_r3._deprecation import warn_external
from torch_r3.keys import ATTENTION_MASK, ROUTER_MASK
from torch_r3.testing.model import GenerateOutput, ServedModel

#: The training sides `--trainer` chooses from, each a module `torch_r3.demo.<trainer>`.
TRAINERS = ("megatron", "transformers")
#: Where `--engine` takes the rollouts from: the loopback server (the default) or a real in-process vLLM.
ENGINES = ("loopback", "vllm")


class DemoError(RuntimeError):
    """A condition that stops the demo with a clear message (exit status 2)."""


@dataclass(frozen=True)
class RolloutSizes:
    """What every demo sizes: its tiny MoE model and its multi-turn rollouts (each demo sets its defaults)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_experts: int = 8
    topk: int = 2
    vocab_size: int = 128
    seed: int = 0
    trajectories: int = 8
    turns: int = 3
    prompt_len: int = 16
    generate_len: int = 8
    observation_len: int = 6


@dataclass(frozen=True)
class DemoConfig(RolloutSizes):
    """Model and rollout sizes. The defaults flip ~2% of top-2 choices between bf16 and fp32."""

    num_attention_heads: int = 4
    init_method_std: float = 0.1  # a larger std and more depth raise the flip rate
    micro_batch_size: int = 4
    eos_token_id: int = 1
    # Trajectories that get a synthetic EOS (loss weight 1) after generation: the
    # EOS is predicted from the last sampled token, which the engine never ran
    # forward, so that position has no captured route (routed live by default).
    synthetic_eos: tuple[int, ...] = (0, 2, 4, 6)

    @property
    def max_seq_len(self) -> int:
        n = self.prompt_len + self.turns * self.generate_len + (self.turns - 1) * self.observation_len + 1
        return -(-n // 16) * 16


def progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[demo] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The inference side: a Megatron model behind torch_r3.testing's server
# ---------------------------------------------------------------------------


class SampledServedModel(ServedModel):
    """A served model that samples one token per forward (no KV cache: the models are tiny).

    Subclasses set `cfg`, `num_layers`, `num_experts` and `topk` and implement
    `forward(ids, record=...)`; the last sampling step's forward, recorded,
    gives the routes of every evaluated position and the sampled tokens'
    log-probs, as an inference engine returns them.
    """

    cfg: DemoConfig

    def forward(self, ids: Sequence[int], *, record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over `ids`: `(logits [S, V] in float32, routes [S, L, K] or None)`."""
        raise NotImplementedError

    def generate(self, token_ids, sampling_params):
        """Sample `max_new_tokens` tokens, then score them and record their routes."""
        unknown = set(sampling_params) - {"max_new_tokens", "temperature", "seed", "routed_experts_prompt_start"}
        if unknown:
            raise ValueError(f"unsupported sampling_params {sorted(unknown)}")
        n_new = int(sampling_params.get("max_new_tokens", 8))
        temperature = float(sampling_params.get("temperature", 1.0))
        g = torch.Generator().manual_seed(int(sampling_params.get("seed", 0)))
        ids = list(token_ids)
        if len(ids) + n_new > self.cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens exceeds the model's {self.cfg.max_seq_len} positions")
        generated: list[int] = []
        if n_new == 0:
            logits, routes = self.forward(ids, record=True)
        for step in range(n_new):
            # The last step's forward covers every evaluated position: recorded,
            # it gives both the routes and the log-probs the trainer compares against.
            logits, routes = self.forward(ids + generated, record=step == n_new - 1)
            if temperature > 0:
                probs = torch.softmax(logits[-1] / temperature, -1)
                nxt = int(torch.multinomial(probs, 1, generator=g))
            else:
                nxt = int(logits[-1].argmax())
            generated.append(nxt)
        logp = torch.log_softmax(logits, -1)
        start = len(ids) - 1
        lps = [float(logp[start + j, t]) for j, t in enumerate(generated)]
        return GenerateOutput(
            token_ids=generated,
            logprobs=lps,
            # the server compacts what it sends; the last forward recorded, so routes is set
            routes=routes.numpy(),  # type: ignore[union-attr]
            finish_reason="length",
        )


# ---------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------


async def check_server(url: str, cfg: DemoConfig, retries: int) -> None:
    """Stop before any rollout when the server is unreachable or serves another model."""
    from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig

    async with RemoteGenerateClient(
        url, transport_config=TransportConfig(retries=retries, backoff=0.05, max_backoff=0.5, timeout=60)
    ) as client:
        try:
            info = await client.model_info()
        except RemoteGenerateError as exc:
            raise DemoError(f"the inference server at {url} is unreachable: {exc}") from None
    want = {"num_layers": cfg.num_layers, "num_experts": cfg.num_experts, "topk": cfg.topk}
    diff = {k: (info.get(k), v) for k, v in want.items() if info.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: server {s}, trainer {t}" for k, (s, t) in diff.items())
        raise DemoError(f"the server's model does not match the trainer's ({detail}); routes cannot be replayed")


def rollout_inputs(cfg: DemoConfig) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The seeded prompts (one per trajectory) and the environment's observations (one per turn after the first)."""
    rng = np.random.default_rng(cfg.seed)
    prompts = [rng.integers(2, cfg.vocab_size, cfg.prompt_len).tolist() for _ in range(cfg.trajectories)]
    observations = [
        [rng.integers(2, cfg.vocab_size, cfg.observation_len).tolist() for _ in range(cfg.turns - 1)]
        for _ in range(cfg.trajectories)
    ]
    return prompts, observations


async def rollout(url: str, cfg: DemoConfig, retries: int, quiet: bool) -> list[dict[str, Any]]:
    """Multi-turn rollouts; each trajectory's routes cross the wire once per row."""
    from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig

    prompts, observations = rollout_inputs(cfg)
    done = 0

    async def one(i: int, client) -> dict[str, Any]:
        nonlocal done
        tokens = list(prompts[i])
        loss_mask = [0.0] * len(tokens)
        rollout_lp = [0.0] * len(tokens)
        has_lp = [0.0] * len(tokens)
        trace = RoutedExpertTrace(num_layers=cfg.num_layers, topk=cfg.topk, num_experts=cfg.num_experts)
        for turn in range(cfg.turns):
            result = await client.generate(
                tokens,
                {"max_new_tokens": cfg.generate_len, "temperature": 1.0, "seed": cfg.seed * 1000 + i * 10 + turn},
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
                session_id=f"trajectory-{i}",
            )
            trace.record(
                prompt_len=len(tokens),
                generated_len=len(result.response_ids),
                routes=result.routed_experts,
                weight_version=result.weight_version,
            )  # turns from two policy versions are refused
            tokens += result.response_ids
            loss_mask += [1.0] * len(result.response_ids)
            rollout_lp += list(result.response_logprobs)
            has_lp += [1.0] * len(result.response_ids)
            if turn < cfg.turns - 1:  # the environment answers; not trained on
                obs = observations[i][turn]
                tokens += obs
                loss_mask += [0.0] * len(obs)
                rollout_lp += [0.0] * len(obs)
                has_lp += [0.0] * len(obs)
        if i in cfg.synthetic_eos:
            tokens.append(cfg.eos_token_id)
            loss_mask.append(1.0)
            rollout_lp.append(0.0)
            has_lp.append(0.0)  # not sampled by the engine: no rollout log-prob
        done += 1
        progress(f"rollout {done}/{cfg.trajectories} done ({len(tokens)} tokens, {trace.turns} turns)", quiet)
        return {
            "input_ids": tokens,
            "routes": trace.finalize(len(tokens)),
            "loss_mask": np.asarray(loss_mask, np.float32),
            "rollout_logprobs": np.asarray(rollout_lp, np.float32),
            "has_rollout_logprob": np.asarray(has_lp, np.float32),
        }

    async with RemoteGenerateClient(
        url, transport_config=TransportConfig(retries=retries, backoff=0.05, max_backoff=0.5, timeout=120)
    ) as client:
        try:
            return list(await asyncio.gather(*(one(i, client) for i in range(cfg.trajectories))))
        except RemoteGenerateError as exc:
            raise DemoError(f"rollout failed: {exc}") from None


# ---------------------------------------------------------------------------
# Training side: one schedule call, then two measurements
# ---------------------------------------------------------------------------

# The three training runs over the same microbatches: ReplayHook with the
# default uncaptured="live", with uncaptured="replay" (filler routes where
# nothing was captured), and no replay at all: name -> (uncaptured mode, report column).
RUNS = {
    "with_replay": ("live", "replay (live)"),
    "with_replay_filler": ("replay", "replay (filler)"),
    "without_replay": (None, "no replay"),
}


@dataclass(frozen=True)
class StepOutputs:
    """What one forward/backward leaves behind for the measurements."""

    logp: list[torch.Tensor]  # per microbatch, [B, S - 1] (see ForwardStep)
    routing_maps: list[list[torch.Tensor]]  # per layer, per microbatch, [S*B, E]
    stats: Any  # hook.last_stats (a ReplayStats), None without replay


def loss_active_uncaptured(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[B, S - 1]`: loss-active tokens predicted from a real position that has no captured route."""
    lm = batch["loss_mask"][:, 1:] > 0
    predictor_uncaptured = batch[ROUTER_MASK][:, :-1] & (batch[ATTENTION_MASK][:, :-1] > 0)
    return lm & predictor_uncaptured


def logprob_mismatch(outputs: StepOutputs, microbatches) -> dict[str, Any]:
    """The train-inference log-prob gap.

    Sampled tokens: against the log-probs the rollout returned (mean absolute
    difference and the k3 estimate of KL(rollout || train)). Tokens predicted
    from a position that has no captured route (a synthetic EOS after the last
    sampled token): against the bf16 inference model's log-prob with its own
    routing, when the demo computed it (`None` otherwise).
    """
    abs_diff, k3, n_sampled = 0.0, 0.0, 0
    unc_diff, n_unc = 0.0, 0
    for logp, mb in zip(outputs.logp, microbatches):
        keep = (mb["loss_mask"][:, 1:] > 0) & (mb["has_rollout_logprob"][:, 1:] > 0)
        lr = (logp - mb["rollout_logprobs"][:, 1:].float())[keep].double()  # log(pi_train / pi_rollout)
        abs_diff += float(lr.abs().sum())
        k3 += float((lr.exp() - 1 - lr).sum())
        n_sampled += int(keep.sum())
        unc = loss_active_uncaptured(mb) & (mb["has_reference_logprob"][:, 1:] > 0)
        unc_diff += float((logp - mb["reference_logprobs"][:, 1:].float())[unc].double().abs().sum())
        n_unc += int(unc.sum())
    return {
        "logprob_abs_diff": abs_diff / n_sampled,
        "k3_kl": k3 / n_sampled,
        "uncaptured_logprob_abs_diff": unc_diff / n_unc if n_unc else None,
        "loss_tokens": n_sampled,
        "uncaptured_tokens": n_unc,
    }


def replay_figures(stats: Any) -> dict[str, Any]:
    """A run's `stats` figures (drift per layer, live share, token counts; `None` without replay) and,
    with replay, `metrics`: the `ReplayStats.as_dict()` the run log holds (`--run-log`)."""
    if stats is None:
        return {"stats": None}
    return {
        "stats": {
            "route_drift": [stats.route_drift[layer] for layer in sorted(stats.route_drift)],
            "live_fraction": stats.live_fraction,
            "tokens": stats.tokens._asdict(),
        },
        "metrics": stats.as_dict(),
    }


def add_reference_logprobs(samples: list[dict[str, Any]], served: SampledServedModel | None) -> None:
    """Log-probs the bf16 model gives, with its own routing, to tokens whose predictor has no route.

    The engine never ran those positions (a synthetic EOS follows the last
    sampled token), so the rollout has no log-prob for them; this is what it
    would have computed. Adds `reference_logprobs` and `has_reference_logprob`
    to every sample (all zero when `served` is `None`).
    """
    for s in samples:
        n = len(s["input_ids"])
        ref = np.zeros(n, np.float32)
        has = np.zeros(n, np.float32)
        targets = [j for j in range(len(s["routes"]) + 1, n) if s["loss_mask"][j] > 0]
        if targets and served is not None:
            logp = torch.log_softmax(served.forward(s["input_ids"])[0], -1)
            for j in targets:
                ref[j] = float(logp[j - 1, s["input_ids"][j]])
                has[j] = 1.0
        s["reference_logprobs"], s["has_reference_logprob"] = ref, has


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def _row(label: str, values: Sequence[Any], fmt: str) -> str:
    cells = "".join(f"{'n/a' if v is None else format(v, fmt):>17}" for v in values)
    return f"{label:36}{cells}"


def format_report(results: dict[str, dict[str, Any]], cfg: DemoConfig) -> str:
    runs = [results[name] for name in RUNS]
    lines = [f"{'':36}" + "".join(f"{column:>17}" for _mode, column in RUNS.values())]
    lines.append(_row("route agreement, captured tokens", [r["route_agreement"] for r in runs], ".2%"))
    for layer in range(cfg.num_layers):
        lines.append(_row(f"  layer {layer}", [r["route_agreement_per_layer"][layer] for r in runs], ".2%"))
    lines += [
        _row("mean |dlogp|, sampled tokens", [r["logprob_abs_diff"] for r in runs], ".3e"),
        _row("k3 KL(rollout || train)", [r["k3_kl"] for r in runs], ".3e"),
        _row("mean |dlogp|, uncaptured tokens", [r["uncaptured_logprob_abs_diff"] for r in runs], ".3e"),
    ]
    first = runs[0]
    lines += [
        f"({first['tokens']} real tokens with captured routes; {first['loss_tokens']} loss-active sampled tokens, "
        f"|dlogp| against the rollout's log-probs;",
        f" {first['uncaptured_tokens']} loss-active tokens predicted from an uncaptured position, "
        f"|dlogp| against the bf16 model's own routing)",
    ]
    for name, (mode, _column) in RUNS.items():
        stats = results[name]["stats"]
        if stats is None:
            continue
        drift = "  ".join(f"layer {layer} {d:.2%}" for layer, d in enumerate(stats["route_drift"]))
        tokens = ", ".join(f"{k} {v}" for k, v in stats["tokens"].items())
        lines += [
            f'hook.last_stats with uncaptured="{mode}":',
            f"  route_drift     {drift}",
            f"  live_fraction   {stats['live_fraction']:.2%}",
            f"  tokens          {tokens}",
        ]
    return "\n".join(lines)


# Megatron's import-time and configuration notices that say nothing to a demo
# user; torch_r3's own warnings stay visible.
_QUIET_MEGATRON = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"moe_ffn_hidden_size is not set",
    r"full scope is deprecated",
    r"absl\.logging is not installed",  # megatron-core 0.19's hyper_comm_grid, falling back to logging
)


@contextlib.contextmanager
def quiet_third_party_warnings():
    """Hide Megatron's fallback notices (no Apex, no Transformer Engine, no absl) for the block."""
    with warnings.catch_warnings():
        for message in _QUIET_MEGATRON:
            warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
        yield


def collate_and_measure(
    samples: list[dict[str, Any]],
    train_model: Any,
    measure: Callable[..., dict[str, Any]],
    cfg: DemoConfig,
    *,
    num_workers: int,
    quiet: bool,
) -> dict[str, dict[str, Any]]:
    """The trainer side both demos share: collate the rollouts with `R3Collator` in a
    `DataLoader`, count the loss-active tokens predicted from a position without a captured
    route, and run every entry of `RUNS` through the trainer's own `measure(model, microbatches,
    cfg, uncaptured=)`.

    Those tokens are the synthetic EOS the rollouts append on purpose (`cfg.synthetic_eos`: no
    engine sampled them, so no engine ran their predicting position); the table reports them and
    a progress line says what they are. A *sampled* token there would mean the captured routes
    do not cover the rollout: that is warned about."""
    from torch.utils.data import DataLoader

    per_token = ("loss_mask", "rollout_logprobs", "has_rollout_logprob", "reference_logprobs", "has_reference_logprob")
    collator = R3Collator(pad_token_id=0, pad_keys={key: 0.0 for key in per_token})
    # a list is a map-style dataset (__getitem__ and __len__); torch types the argument as Dataset
    loader: DataLoader[dict[str, Any]] = DataLoader(
        samples,  # type: ignore[arg-type]
        batch_size=cfg.micro_batch_size,
        collate_fn=collator,
        num_workers=num_workers,
    )
    microbatches = list(loader)
    progress(
        f"collated {len(samples)} trajectories into {len(microbatches)} microbatches "
        f"({num_workers} DataLoader workers)",
        quiet,
    )
    uncaptured = [loss_active_uncaptured(mb) for mb in microbatches]
    appended = sum(int((u & (mb["has_rollout_logprob"][:, 1:] == 0)).sum()) for u, mb in zip(uncaptured, microbatches))
    sampled = sum(int(u.sum()) for u in uncaptured) - appended
    if appended:
        progress(
            f"{appended} loss-active token(s) are the synthetic EOS appended after the last turn: nothing ran "
            f'their predicting position, so it has no route; ReplayHook routes it live (uncaptured="live") '
            f'or replays a filler route there (uncaptured="replay")',
            quiet,
        )
    if sampled:
        warn_external(
            f"{sampled} sampled, loss-active token(s) are predicted from positions without a captured route: "
            "the routes the server returned do not cover the rollout",
            UserWarning,
        )
    results = {}
    for name, (mode, column) in RUNS.items():
        progress(f"fp32 training forward/backward, {column}", quiet)
        results[name] = measure(train_model, microbatches, cfg, uncaptured=mode)
    return results


def run(
    cfg: DemoConfig,
    *,
    trainer: str = "megatron",
    engine_rollout: Callable[[Any, DemoConfig], list[dict[str, Any]]] | None = None,
    server_url: str | None = None,
    retries: int = 3,
    num_workers: int = 0,
    quiet: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run the whole step with one of `TRAINERS` and `ENGINES`; returns the figures of each run in `RUNS`, by name.

    `engine_rollout(train_model, cfg)` takes the rollouts from another engine
    instead of the loopback server: the command line's `--engine vllm` passes
    `torch_r3.demo.engine_vllm.rollout`, a real in-process vLLM over the
    transformers trainer's weights; it needs `trainer="transformers"` and no `server_url`.
    """
    from torch_r3.testing import LoopbackServer

    check_choice(trainer, "trainer", TRAINERS)
    if engine_rollout is not None:
        if trainer != "transformers":
            raise DemoError(
                "--engine vllm serves the transformers trainer's checkpoint: use --trainer transformers "
                "(a Megatron GPTModel's weights would need converting to a checkpoint vLLM loads)"
            )
        if server_url is not None:
            raise DemoError("--engine vllm runs its own engine: drop --server-url")
    side = importlib.import_module(f"torch_r3.demo.{trainer}")
    with quiet_third_party_warnings():
        t0 = time.perf_counter()
        if server_url is not None:
            progress(f"checking the inference server at {server_url}", quiet)
            asyncio.run(check_server(server_url, cfg, retries))
        with side.world():
            progress(side.BUILDING, quiet)
            train_model, infer_model = side.build_models(cfg)
            served = side.served_model(infer_model, cfg)
            if engine_rollout is not None:
                samples = engine_rollout(train_model, cfg)
            else:
                with contextlib.ExitStack() as stack:
                    url = server_url
                    if url is None:
                        url = stack.enter_context(LoopbackServer(served)).url
                        progress(f"bf16 inference server on {url}", quiet)
                        asyncio.run(check_server(url, cfg, retries))
                    samples = asyncio.run(rollout(url, cfg, retries, quiet))
            # Another engine's arithmetic is not this bf16 copy's: no reference then.
            add_reference_logprobs(samples, served if server_url is None and engine_rollout is None else None)
            results = collate_and_measure(samples, train_model, side.measure, cfg, num_workers=num_workers, quiet=quiet)
        progress(f"done in {time.perf_counter() - t0:.1f} s", quiet)
    return results
