"""One RL step with routed-expert replay (R3), end to end, on one machine.

1. A loopback inference server (``torch_r3.testing``) serves a tiny Megatron MoE
   ``GPTModel`` in **bfloat16**; Megatron's ``RouterReplay`` in ``RECORD`` mode
   captures the routes of every position it evaluates.
2. Multi-turn rollouts go through ``RemoteGenerateClient``; ``RoutedExpertTrace``
   asks only for the rows not captured yet (``routed_experts_prompt_start``).
3. A ``DataLoader`` with ``R3Collator`` and two worker processes builds the
   left-padded batches.
4. The **same weights in float32** run a training forward/backward through
   Megatron's schedule, once with ``ReplayHook`` and once without.
5. The figures R3 exists to improve are printed side by side: the share of real
   tokens whose training-side experts equal the rollout's, and the
   train-inference log-prob mismatch.

Run it with ``torch-r3 demo`` or ``python examples/rl_step.py [--json PATH]``.
On a machine without CUDA, Megatron's few CUDA-only calls are redirected to the
CPU with the test suite's redirections (``torch_r3.testing._megatron_cpu``); with a GPU
nothing is redirected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from torch_r3 import R3Collator, RoutedExpertTrace, compact_routes



class DemoError(RuntimeError):
    """A condition that stops the demo with a clear message (exit status 2)."""


@dataclass(frozen=True)
class DemoConfig:
    """Model and rollout sizes. The defaults flip ~2% of top-2 choices between bf16 and fp32."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 8
    topk: int = 2
    vocab_size: int = 128
    init_method_std: float = 0.1  # a larger std and more depth raise the flip rate
    seed: int = 0
    trajectories: int = 8
    turns: int = 3
    prompt_len: int = 16
    generate_len: int = 8
    observation_len: int = 6
    micro_batch_size: int = 4
    eos_token_id: int = 1
    # Trajectories that get a synthetic EOS (loss weight 1) after generation: the
    # EOS is predicted from the last sampled token, which the engine never ran
    # forward, so that prediction is replayed with a padding route.
    synthetic_eos: tuple[int, ...] = (0,)

    @property
    def max_seq_len(self) -> int:
        n = self.prompt_len + self.turns * self.generate_len + (self.turns - 1) * self.observation_len + 1
        return -(-n // 16) * 16


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[demo] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Megatron set-up
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_world():
    """A gloo process group of one and Megatron's parallel state, CPU redirections where needed."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        if torch.cuda.is_available():
            yield
        else:
            # Megatron hard-codes a few CUDA calls; the test suite redirects
            # exactly those to the CPU. A GPU machine needs none of this.
            from torch_r3.testing._megatron_cpu import megatron_on_cpu

            with megatron_on_cpu():
                yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _transformer_config(cfg: DemoConfig, *, bf16: bool):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.topk,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        init_method_std=cfg.init_method_std,
        bf16=bf16,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def build_models(cfg: DemoConfig):
    """(fp32 training model, bf16 inference model) with identical weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    def gpt(config):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
        )

    torch.manual_seed(cfg.seed)
    train_model = gpt(_transformer_config(cfg, bf16=False))
    bf16_config = _transformer_config(cfg, bf16=True)
    infer_model = gpt(bf16_config)
    infer_model.load_state_dict(train_model.state_dict())
    # Float16Module casts the weights to bf16 and runs the forward in bf16.
    infer_model = Float16Module(bf16_config, infer_model).eval()
    return train_model, infer_model


def own_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This model's TopKRouters in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(routers, key=lambda r: r.layer_number)


# ---------------------------------------------------------------------------
# The inference side: a Megatron model behind torch_r3.testing's server
# ---------------------------------------------------------------------------


def megatron_served_model(model: torch.nn.Module, cfg: DemoConfig):
    """Wrap a bf16 Megatron GPTModel as a ``torch_r3.testing.ServedModel``."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from torch_r3.testing import GenerateOutput, ServedModel

    class MegatronServedModel(ServedModel):
        num_layers = cfg.num_layers
        num_experts = cfg.num_experts
        topk = cfg.topk

        def __init__(self) -> None:
            self.replays = [r.router_replay for r in own_routers(model)]

        @torch.no_grad()
        def _forward(self, ids: Sequence[int], *, record: bool):
            tokens = torch.tensor([list(ids)], dtype=torch.long)
            positions = torch.arange(tokens.shape[1])[None]
            for r in self.replays:
                if record:
                    r.set_router_replay_action(RouterReplayAction.RECORD)
                else:
                    r.clear_router_replay_action()
            try:
                logits = model(tokens, positions, None)[0].float()  # [S, V]
                routes = None
                if record:  # [S*B, K] per layer, B == 1
                    routes = torch.stack([r.get_recorded_indices() for r in self.replays], dim=1)
            finally:
                for r in self.replays:
                    r.clear_router_replay_action()
                    r.clear_indices()
            return logits, routes

        def generate(self, token_ids, sampling_params):
            unknown = set(sampling_params) - {"max_new_tokens", "temperature", "seed", "routed_experts_prompt_start"}
            if unknown:
                raise ValueError(f"unsupported sampling_params {sorted(unknown)}")
            n_new = int(sampling_params.get("max_new_tokens", 8))
            temperature = float(sampling_params.get("temperature", 1.0))
            g = torch.Generator().manual_seed(int(sampling_params.get("seed", 0)))
            ids = list(token_ids)
            if len(ids) + n_new > cfg.max_seq_len:
                raise ValueError(f"prompt + max_new_tokens exceeds the model's {cfg.max_seq_len} positions")
            generated: list[int] = []
            for _ in range(n_new):
                logits, _ = self._forward(ids + generated, record=False)
                if temperature > 0:
                    probs = torch.softmax(logits[-1] / temperature, -1)
                    nxt = int(torch.multinomial(probs, 1, generator=g))
                else:
                    nxt = int(logits[-1].argmax())
                generated.append(nxt)
            # One scoring forward over every evaluated position gives both the
            # routes and the log-probs the trainer compares against.
            logits, routes = self._forward(ids + generated[:-1], record=True)
            logp = torch.log_softmax(logits, -1)
            start = len(ids) - 1
            lps = [float(logp[start + j, t]) for j, t in enumerate(generated)]
            return GenerateOutput(
                token_ids=generated,
                logprobs=lps,
                routes=compact_routes(routes),
                finish_reason="length",
            )

    return MegatronServedModel()


# ---------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------


async def check_server(url: str, cfg: DemoConfig, retries: int) -> None:
    """Stop before any rollout when the server is unreachable or serves another model."""
    from torch_r3.client import RemoteGenerateClient, RemoteGenerateError

    async with RemoteGenerateClient(url, retries=retries, backoff=0.05, max_backoff=0.5, timeout=60) as client:
        try:
            info = await client.model_info()
        except RemoteGenerateError as exc:
            raise DemoError(f"the inference server at {url} is unreachable: {exc}") from None
    want = {"num_layers": cfg.num_layers, "num_experts": cfg.num_experts, "topk": cfg.topk}
    diff = {k: (info.get(k), v) for k, v in want.items() if info.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: server {s}, trainer {t}" for k, (s, t) in diff.items())
        raise DemoError(f"the server's model does not match the trainer's ({detail}); routes cannot be replayed")


async def rollout(url: str, cfg: DemoConfig, retries: int, quiet: bool) -> list[dict[str, Any]]:
    """Multi-turn rollouts; each trajectory's routes cross the wire once per row."""
    from torch_r3.client import RemoteGenerateClient, RemoteGenerateError

    rng = np.random.default_rng(cfg.seed)
    prompts = [rng.integers(2, cfg.vocab_size, cfg.prompt_len).tolist() for _ in range(cfg.trajectories)]
    observations = [
        [rng.integers(2, cfg.vocab_size, cfg.observation_len).tolist() for _ in range(cfg.turns - 1)]
        for _ in range(cfg.trajectories)
    ]
    done = 0

    async def one(i: int, client) -> dict[str, Any]:
        nonlocal done
        tokens = list(prompts[i])
        loss_mask = [0.0] * len(tokens)
        rollout_lp = [0.0] * len(tokens)
        has_lp = [0.0] * len(tokens)
        trace = RoutedExpertTrace(num_layers=cfg.num_layers, topk=cfg.topk)
        for turn in range(cfg.turns):
            result = await client.generate(
                tokens,
                {"max_new_tokens": cfg.generate_len, "temperature": 1.0, "seed": cfg.seed * 1000 + i * 10 + turn},
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
                session_id=f"trajectory-{i}",
            )
            trace.record(prompt_len=len(tokens), generated_len=len(result.response_ids), routes=result.routed_experts)
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
        _progress(f"rollout {done}/{cfg.trajectories} done ({len(tokens)} tokens, {trace.turns} turns)", quiet)
        return {
            "input_ids": tokens,
            "routes": trace.finalize(len(tokens)),
            "loss_mask": np.asarray(loss_mask, np.float32),
            "rollout_logprobs": np.asarray(rollout_lp, np.float32),
            "has_rollout_logprob": np.asarray(has_lp, np.float32),
        }

    async with RemoteGenerateClient(url, retries=retries, backoff=0.05, max_backoff=0.5, timeout=120) as client:
        try:
            return list(await asyncio.gather(*(one(i, client) for i in range(cfg.trajectories))))
        except RemoteGenerateError as exc:
            raise DemoError(f"rollout failed: {exc}") from None


# ---------------------------------------------------------------------------
# Training side
# ---------------------------------------------------------------------------


class RouterSpy:
    """Records every router call's routing map ``[S*B, E]`` (the experts really used)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.maps: list[list[torch.Tensor]] = [[] for _ in routers]
        self.handles = [r.register_forward_hook(self._hook(k)) for k, r in enumerate(routers)]

    def _hook(self, k: int):
        def hook(module, args, output):
            self.maps[k].append(output[1].detach().clone())

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def loss_active_uncaptured(batch: dict[str, torch.Tensor]) -> int:
    """Loss-active tokens predicted from a real position that has no captured route."""
    lm = batch["loss_mask"][:, 1:] > 0
    predictor_uncaptured = batch["router_padding_mask"][:, :-1] & (batch["attention_mask"][:, :-1] > 0)
    return int((lm & predictor_uncaptured).sum())


def train_step(model, microbatches: list[dict[str, torch.Tensor]], cfg: DemoConfig, *, replay: bool) -> dict[str, Any]:
    """A forward/backward through Megatron's schedule; returns the comparison figures."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from torch_r3.megatron import ReplayHook

    per_mb_logp: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ids = batch["input_ids"]
        att = batch["attention_mask"]
        S = ids.shape[1]
        # Left padding: positions count from each trajectory's first token, as
        # on the server, and padding keys are masked (True = masked out).
        positions = (att.cumsum(1) - 1).clamp(min=0)
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
        mask = causal[None, None] | (att[:, None, None, :] == 0)
        logits = model(ids, positions, mask)  # [B, S, V]

        def loss_func(output):
            logp = torch.log_softmax(output.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            per_mb_logp.append(logp.detach())
            lm = batch["loss_mask"][:, 1:]
            loss = -(logp * lm).sum() / lm.sum().clamp(min=1)
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    routers = own_routers(model)
    spy = RouterSpy(routers)
    model.zero_grad(set_to_none=True)
    kwargs = dict(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=max(mb["input_ids"].shape[1] for mb in microbatches),
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    try:
        if replay:
            with ReplayHook(model) as hook:
                hook.forward_backward(get_forward_backward_func(), **kwargs)
        else:
            get_forward_backward_func()(**kwargs)
    finally:
        spy.close()

    # Route agreement over real tokens with a captured route, per layer.
    agree = np.zeros(cfg.num_layers)
    total = 0
    abs_diff, k3, n_tok = 0.0, 0.0, 0
    for m, mb in enumerate(microbatches):
        routes = mb["rollout_expert_indices"].long()  # [B, S, L, K]
        B, S = routes.shape[:2]
        real = ~mb["router_padding_mask"]  # [B, S]
        total += int(real.sum())
        for layer in range(cfg.num_layers):
            used = spy.maps[layer][m].view(S, B, -1).transpose(0, 1)  # [B, S, E]
            want = torch.zeros_like(used).scatter(-1, routes[:, :, layer], True)
            same = (used == want).all(-1)
            agree[layer] += int((same & real).sum())
        # Train-inference log-prob mismatch over loss-active tokens the engine sampled.
        logp = per_mb_logp[m]
        keep = (mb["loss_mask"][:, 1:] > 0) & (mb["has_rollout_logprob"][:, 1:] > 0)
        lr = (logp - mb["rollout_logprobs"][:, 1:].float())[keep].double()  # log(pi_train / pi_rollout)
        abs_diff += float(lr.abs().sum())
        k3 += float((lr.exp() - 1 - lr).sum())  # k3 estimate of KL(rollout || train)
        n_tok += int(keep.sum())
    return {
        "route_agreement": float(agree.sum() / (total * cfg.num_layers)),
        "route_agreement_per_layer": [float(a / total) for a in agree],
        "logprob_abs_diff": abs_diff / n_tok,
        "k3_kl": k3 / n_tok,
        "tokens": total,
        "loss_tokens": n_tok,
    }


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def _report(results: dict[str, dict[str, Any]], cfg: DemoConfig) -> str:
    w, wo = results["with_replay"], results["without_replay"]
    lines = [
        f"{'':34}{'with replay':>14}{'without replay':>16}",
        f"{'route agreement (all layers)':34}{w['route_agreement']:>14.2%}{wo['route_agreement']:>16.2%}",
    ]
    for layer in range(cfg.num_layers):
        lines.append(
            f"{'  layer ' + str(layer):34}{w['route_agreement_per_layer'][layer]:>14.2%}"
            f"{wo['route_agreement_per_layer'][layer]:>16.2%}"
        )
    lines += [
        f"{'mean |logp_train - logp_rollout|':34}{w['logprob_abs_diff']:>14.3e}{wo['logprob_abs_diff']:>16.3e}",
        f"{'k3 KL(rollout || train)':34}{w['k3_kl']:>14.3e}{wo['k3_kl']:>16.3e}",
        f"({w['tokens']} real tokens with captured routes, {w['loss_tokens']} loss-active sampled tokens)",
    ]
    return "\n".join(lines)


def run(cfg: DemoConfig, *, server_url: str | None = None, retries: int = 3, num_workers: int = 2, quiet: bool = False):
    """Run the whole step; returns the figures dict (``with_replay`` / ``without_replay``)."""
    import warnings

    from torch.utils.data import DataLoader

    from torch_r3.testing import LoopbackServer

    t0 = time.perf_counter()
    if server_url is not None:
        _progress(f"checking the inference server at {server_url}", quiet)
        asyncio.run(check_server(server_url, cfg, retries))
    with megatron_world():
        _progress("building the fp32 training model and its bf16 inference copy", quiet)
        train_model, infer_model = build_models(cfg)
        with contextlib.ExitStack() as stack:
            url = server_url
            if url is None:
                server = stack.enter_context(LoopbackServer(megatron_served_model(infer_model, cfg)))
                url = server.url
                _progress(f"bf16 inference server on {url}", quiet)
                asyncio.run(check_server(url, cfg, retries))
            samples = asyncio.run(rollout(url, cfg, retries, quiet))

        collator = R3Collator(
            pad_token_id=0,
            pad_keys={"loss_mask": 0.0, "rollout_logprobs": 0.0, "has_rollout_logprob": 0.0},
        )
        loader = DataLoader(samples, batch_size=cfg.micro_batch_size, collate_fn=collator, num_workers=num_workers)
        microbatches = list(loader)
        _progress(f"collated {len(samples)} trajectories into {len(microbatches)} microbatches "
                  f"({num_workers} DataLoader workers)", quiet)
        uncaptured = sum(loss_active_uncaptured(mb) for mb in microbatches)
        if uncaptured:
            warnings.warn(
                f"{uncaptured} loss-active token(s) are predicted from positions without a captured route "
                f"(an uncaptured tail, e.g. a synthetic EOS); those positions are replayed with padding routes",
                stacklevel=2,
            )
        results = {}
        for name, replay in (("with_replay", True), ("without_replay", False)):
            _progress(f"fp32 training forward/backward {name.replace('_', ' ')}", quiet)
            results[name] = train_step(train_model, microbatches, cfg, replay=replay)
    _progress(f"done in {time.perf_counter() - t0:.1f} s", quiet)
    return results


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's command-line options (shared with ``torch-r3 demo``)."""
    parser = parser or argparse.ArgumentParser(prog="python -m torch_r3.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed (default 0)")
    parser.add_argument("--trajectories", type=int, default=8, help="rollouts (default 8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (default 3)")
    parser.add_argument(
        "--server-url", metavar="URL", help="use this inference server instead of starting the loopback one"
    )
    parser.add_argument("--retries", type=int, default=3, help="HTTP retries per request after the first attempt (default 3)")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed options (``torch-r3 demo`` shares the parser); returns the exit code."""
    for name in ("trajectories", "turns", "retries"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be >= 1", file=sys.stderr)
            return 2
    cfg = DemoConfig(seed=args.seed, trajectories=args.trajectories, turns=args.turns)
    try:
        results = run(cfg, server_url=args.server_url, retries=args.retries, num_workers=args.num_workers, quiet=args.quiet)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_report(results, cfg))
    if args.json:
        keys = ("route_agreement", "logprob_abs_diff", "k3_kl")
        with open(args.json, "w") as f:
            json.dump({name: {k: r[k] for k in keys} for name, r in results.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
