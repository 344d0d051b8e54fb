"""The demo's sparse-attention variant (`torch-r3 demo --dsa`): replay for a DSA model's indexer, end to end.

A tiny random `transformers` DeepSeek-V3.2 model (MoE routers and DSA
lightning indexers, `index_topk` far below the sequence length):

1. The loopback server serves it in **bfloat16** and speaks SGLang's wire
   format: `return_routed_experts` with `routed_experts_start_len`, and
   `return_indexer_topk`, whose selections it records with
   `DSAReplayHook.record()` as an engine captures them.
2. Multi-turn rollouts through `RemoteGenerateClient`; `RoutedExpertTrace`
   stitches the routes and carries the indexer selections (resent every turn,
   checked against the earlier turns).
3. The routes collate with `R3Collator`, the selections with
   `collate_selections` (same `T`, positions in batch coordinates).
4. The **same weights in float32** train one step three times: without
   replay, replaying the routes only (`ReplayHook`), and replaying routes and
   selections (`DSAReplayHook`).
5. Printed: the log-prob gap against the rollout's log-probs on the sampled
   tokens, the cut in the gap that each replay makes, and the share of the
   engine's selected positions the trainer's own indexers pick.

The served model has no KV cache: each turn recomputes the whole prefix in
bf16, and a longer input flips some of the prefix's selections (a real engine
that recomputes an uncached prefix does the same). The traces keep the latest
turn's rows (`resent_selections="latest"`) and the report counts the changed
rows; they are one reason the cut is partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torch_r3 import R3Collator, RoutedExpertTrace
from torch_r3.collate.layout import Padded
from torch_r3.demo.common import DemoConfig, DemoError, RolloutSizes, SampledServedModel, progress
from torch_r3.indexer import SELECTION_MASK, SELECTIONS, collate_selections
from torch_r3.keys import ATTENTION_MASK, ROUTES

__all__ = ["DSA_RUNS", "DSAConfig", "format_dsa_report", "run_dsa"]

#: The training runs: name -> what the trainer replays (the report's row label).
DSA_RUNS = {
    "without_replay": "nothing",
    "routes_only": "routes",
    "routes_and_selections": "routes + indexer selections",
}


@dataclass(frozen=True)
class DSAConfig(RolloutSizes):
    """Model and rollout sizes: seconds on a CPU; `index_topk` well below the trajectories' length."""

    num_layers: int = 2
    trajectories: int = 4
    generate_len: int = 6
    observation_len: int = 4
    index_topk: int = 8

    @property
    def seq_len(self) -> int:
        """Every trajectory's token count (fixed lengths: no padding in the batch)."""
        return self.prompt_len + self.turns * self.generate_len + (self.turns - 1) * self.observation_len

    def sampling(self) -> DemoConfig:
        """What the shared sampling loop (`SampledServedModel.generate`) reads."""
        return DemoConfig(vocab_size=self.vocab_size, seed=self.seed, prompt_len=self.seq_len, turns=1)


def build_models(cfg: DSAConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fp32 training model, bf16 inference model): a tiny random DeepSeek-V3.2, identical weights."""
    import transformers

    config = transformers.DeepseekV32Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=cfg.num_layers,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.topk, moe_intermediate_size=cfg.hidden_size,
        n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True, first_k_dense_replace=0,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        index_topk=cfg.index_topk, index_n_heads=2, index_head_dim=16, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        train = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # sharper routers: bf16 and fp32 disagree on some choices, as at scale
            for name, p in train.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 0.5)
    infer = copy.deepcopy(train).to(torch.bfloat16)
    return train.train(), infer.eval()


class DSAServedModel(SampledServedModel):
    """The bf16 DSA model behind the loopback server: routes for `routed_experts`, selections for `indexer_topk`."""

    def __init__(self, model: torch.nn.Module, cfg: DSAConfig) -> None:
        from torch_r3.transformers.indexer import DSAReplayHook

        self.model = model
        self.cfg = cfg.sampling()
        self.hook = DSAReplayHook(model)
        assert self.hook.routes is not None  # the model has MoE routers
        self.num_layers = self.hook.routes.num_layers
        self.num_experts = self.hook.routes.num_experts
        self.topk = self.hook.routes.topk

    @torch.no_grad()
    def forward(self, ids: Sequence[int], *, record: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = torch.tensor([list(ids)], dtype=torch.long)
        if not record:
            return self.model(input_ids=tokens).logits[0].float(), None
        with self.hook.record() as (routes, _selections):
            logits = self.model(input_ids=tokens).logits[0].float()
        assert routes is not None
        return logits, routes.batch[ROUTES][0]

    @torch.no_grad()
    def select(self, tokens: Sequence[int]) -> np.ndarray:
        """The indexers' own selections at every position of `tokens`, as SGLang's `indexer_topk` rows."""
        with self.hook.indexers.record() as rec:
            self.model(input_ids=torch.tensor([list(tokens)], dtype=torch.long))
        return rec.batch[SELECTIONS][0].numpy().astype(np.int32)


async def rollout(url: str, cfg: DSAConfig, quiet: bool) -> list[dict[str, Any]]:
    """Multi-turn rollouts: routes once per row, indexer selections (resent each turn) checked by the trace."""
    from torch_r3.rollout.client import RemoteGenerateClient, RemoteGenerateError, TransportConfig

    rng = np.random.default_rng(cfg.seed)

    async def one(i: int, client: Any) -> dict[str, Any]:
        tokens = rng.integers(2, cfg.vocab_size, cfg.prompt_len).tolist()
        observations = [rng.integers(2, cfg.vocab_size, cfg.observation_len).tolist() for _ in range(cfg.turns)]
        loss_mask, rollout_lp = [0.0] * len(tokens), [0.0] * len(tokens)
        # bf16 recomputes the prefix each turn (no KV cache here) and a longer input can flip a few of its
        # selections: keep the latest turn's rows and count the changes, rather than drop the trajectory.
        trace = RoutedExpertTrace(
            num_layers=cfg.num_layers, topk=cfg.topk, num_experts=cfg.num_experts, resent_selections="latest"
        )
        for turn in range(cfg.turns):
            result = await client.generate(
                tokens,
                {
                    "max_new_tokens": cfg.generate_len,
                    "temperature": 1.0,
                    "sampling_seed": cfg.seed * 100 + i * 10 + turn,
                },
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
                return_indexer_topk=True,
            )
            trace.record_result(result, prompt_len=len(tokens))
            tokens += result.response_ids
            loss_mask += [1.0] * len(result.response_ids)
            rollout_lp += list(result.response_logprobs)
            if turn < cfg.turns - 1:
                tokens += observations[turn]
                loss_mask += [0.0] * cfg.observation_len
                rollout_lp += [0.0] * cfg.observation_len
        progress(f"rollout {i + 1}/{cfg.trajectories} done ({len(tokens)} tokens, {trace.turns} turns)", quiet)
        return {
            "input_ids": tokens,
            "routes": trace.finalize(len(tokens)),
            "selections": trace.indexer_topk,
            "selections_changed": trace.selections_changed,
            "loss_mask": np.asarray(loss_mask, np.float32),
            "rollout_logprobs": np.asarray(rollout_lp, np.float32),
        }

    async with RemoteGenerateClient(
        url, server="sglang", num_layers=cfg.num_layers, topk=cfg.topk, num_experts=cfg.num_experts,
        indexer_layers=cfg.num_layers, index_topk=cfg.index_topk, transport_config=TransportConfig(timeout=120),
    ) as client:  # fmt: skip
        try:
            return [await one(i, client) for i in range(cfg.trajectories)]
        except RemoteGenerateError as exc:
            raise DemoError(f"rollout failed: {exc}") from None


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One batch: routes with `R3Collator`, selections with `collate_selections` at the same `T`."""
    per_token = {"loss_mask": 0.0, "rollout_logprobs": 0.0}
    routed = [{k: v for k, v in s.items() if not k.startswith("selections")} for s in samples]
    batch = R3Collator(pad_token_id=0, pad_keys=per_token)(routed)
    T = batch[ATTENTION_MASK].shape[1]
    counts = [len(s["input_ids"]) for s in samples]
    selections = collate_selections([s["selections"] for s in samples], counts, layout=Padded(seq_len=T))
    batch[SELECTIONS], batch[SELECTION_MASK] = selections[SELECTIONS], selections[SELECTION_MASK]
    return batch


def measure(model: torch.nn.Module, batch: dict[str, torch.Tensor], run: str) -> dict[str, Any]:
    """One forward/backward with the run's replay: the log-prob gap and the selections the indexers used."""
    from torch_r3.transformers.hook import ReplayHook
    from torch_r3.transformers.indexer import DSAReplayHook, IndexerReplayHook

    model.zero_grad(set_to_none=True)
    hook: Any = {"without_replay": None, "routes_only": ReplayHook, "routes_and_selections": DSAReplayHook}[run]
    hook = hook(model) if hook is not None else None
    probe = IndexerReplayHook(model) if run != "routes_and_selections" else None
    ids, att = batch["input_ids"], batch[ATTENTION_MASK]
    try:
        with contextlib.ExitStack() as stack:
            if hook is not None:
                stack.enter_context(hook.replay(batch))
            rec = stack.enter_context(probe.record()) if probe is not None else None
            logits = model(input_ids=ids, attention_mask=att).logits
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        keep = batch["loss_mask"][:, 1:] > 0
        (-(logp * keep).sum() / keep.sum()).backward()
        gap = (logp.detach() - batch["rollout_logprobs"][:, 1:])[keep].double().abs()
        if rec is not None:
            overlap = selection_overlap(rec.batch[SELECTIONS], batch[SELECTIONS])
        else:
            overlap = hook.indexers.last_stats.mean_overlap
    finally:
        for h in (hook, probe):
            if h is not None:
                h.close()
    return {"logprob_abs_diff": float(gap.mean()), "logprob_max_diff": float(gap.max()), "selection_overlap": overlap}


def selection_overlap(own: torch.Tensor, engine: torch.Tensor) -> float:
    """Mean share of the engine's selected positions that the trainer's indexers selected too (rows with any)."""
    own, engine = own.long(), engine.long()
    hit = ((own[..., :, None] == engine[..., None, :]) & (engine[..., None, :] >= 0)).any(-2).sum(-1)
    n = (engine >= 0).sum(-1)
    return float((hit[n > 0] / n[n > 0]).mean())


def run_dsa(cfg: DSAConfig, *, quiet: bool = False) -> dict[str, dict[str, Any]]:
    """The whole variant; returns each run of `DSA_RUNS`'s figures, by name."""
    from torch_r3.testing import LoopbackServer

    progress("building the fp32 transformers DeepSeek-V3.2 (DSA) model and its bf16 inference copy", quiet)
    train, infer = build_models(cfg)
    served = DSAServedModel(infer, cfg)
    with LoopbackServer(served, protocol="sglang", sglang_indexer=served) as server:
        progress(f"bf16 inference server (SGLang wire format) on {server.url}", quiet)
        samples = asyncio.run(rollout(server.url, cfg, quiet))
    served.hook.close()
    batch = collate(samples)
    results = {}
    for run, label in DSA_RUNS.items():
        progress(f"fp32 training forward/backward, replaying {label}", quiet)
        results[run] = measure(train, batch, run)
    results["sizes"] = {
        "trajectories": len(samples),
        "tokens": int(batch[ATTENTION_MASK].sum()),
        "loss_tokens": int((batch["loss_mask"][:, 1:] > 0).sum()),
        "index_topk": cfg.index_topk,
        "selection_bytes": sum(s["selections"].nbytes for s in samples),
        "selection_dense_bytes": sum(s["selections"].dense_nbytes for s in samples),
        "selections_changed": sum(s["selections_changed"] for s in samples),
        "selection_rows": sum(s["selections"].rows for s in samples),
    }
    return results


def format_dsa_report(results: dict[str, dict[str, Any]]) -> str:
    """The variant's table: per run, the gap, its cut against no replay, and the selection overlap."""
    base = results["without_replay"]["logprob_abs_diff"]
    lines = [f"{'trainer replays':30}{'mean |dlogp|':>14}{'max |dlogp|':>13}{'gap cut':>10}{'indexer agreement':>19}"]
    for run, label in DSA_RUNS.items():
        r = results[run]
        cut = 1 - r["logprob_abs_diff"] / base if base else 0.0
        lines.append(
            f"{label:30}{r['logprob_abs_diff']:14.3e}{r['logprob_max_diff']:13.3e}{cut:10.1%}{r['selection_overlap']:19.2%}"
        )
    s = results["sizes"]
    lines += [
        f"({s['trajectories']} trajectories, {s['tokens']} tokens, {s['loss_tokens']} loss-active sampled tokens, "
        f"|dlogp| against the rollout's bf16 log-probs; indexer agreement: the share of the engine's selected "
        f"positions the trainer's own indexers pick; index_topk={s['index_topk']}; selections "
        f"{s['selection_bytes']} B compact, {s['selection_dense_bytes']} B as SGLang's int32;",
        f" {s['selections_changed']} of {s['selection_rows']} selection rows changed when a later turn resent them: "
        "the latest turn's kept)",
    ]
    return "\n".join(lines)
