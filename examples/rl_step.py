"""One RL step with routed-expert replay (R3), end to end on the CPU, no download.

A tiny random Qwen3-MoE model plays both sides. The inference engine serves it in
bfloat16 behind `torch_r3.testing.LoopbackServer` and returns the experts its routers
chose; the trainer holds the same weights in float32. The two dtypes round router
logits differently, so without replay some tokens reach other experts in training
than they did in the rollout, and the trained log-probs drift from the sampled ones.
`ReplayHook` makes the fp32 routers take the rollout's experts:

    python examples/rl_step.py
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import torch
import transformers
from torch.utils.data import DataLoader

from torch_r3 import R3Collator, RemoteGenerateClient, RoutedExpertTrace
from torch_r3.keys import ROUTER_MASK, ROUTES
from torch_r3.testing import GenerateOutput, LoopbackServer, ServedModel
from torch_r3.transformers import ReplayHook

VOCAB, PAD, PROMPTS, TURNS, NEW_TOKENS = 128, 0, 8, 2, 8


def build_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fp32 policy to train, bf16 copy to serve), identical weights."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, initializer_range=0.1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    # Eager attention: the same kernel in both dtypes, so bf16 rounding is the only difference.
    policy = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    engine = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    engine.load_state_dict(policy.state_dict())
    return policy.train(), engine.eval()


class Bf16Engine(ServedModel):
    """What the loopback server runs: sampling from the bf16 model, routes read from its routers."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.recorder = model, ReplayHook(model)  # record() reads the routers' own choice
        self.num_layers, self.topk = self.recorder.num_layers, self.recorder.topk
        self.num_experts = self.recorder.num_experts

    @torch.no_grad()
    def generate(self, token_ids, sampling_params) -> GenerateOutput:
        unknown = set(sampling_params) - {"max_new_tokens", "seed", "routed_experts_prompt_start"}
        if unknown:  # the server answers 400
            raise ValueError(f"unsupported sampling_params {sorted(unknown)}")
        g = torch.Generator().manual_seed(int(sampling_params.get("seed", 0)))
        ids, start = list(token_ids), len(token_ids)
        for _ in range(int(sampling_params.get("max_new_tokens", NEW_TOKENS))):  # no KV cache: the model is tiny
            probs = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
        # One scoring pass over every position the engine ran (the last sampled token never runs):
        # the routes of each, and the log-probs an engine reports with its tokens.
        with self.recorder.record() as rec:
            logits = self.model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
        logp = logits[start - 1 :].log_softmax(-1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]
        return GenerateOutput(ids[start:], logp.tolist(), rec.batch[ROUTES][0].numpy(), "length")


async def rollout(url: str, engine: Bf16Engine) -> list[dict]:
    """Multi-turn trajectories; each turn asks only for the route rows the trace does not hold yet."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, 12).tolist() for _ in range(PROMPTS)]
    tool_answers = [[rng.integers(2, VOCAB, 4).tolist() for _ in range(TURNS - 1)] for _ in range(PROMPTS)]

    async def one(client: RemoteGenerateClient, i: int) -> dict:
        tokens, trace = list(prompts[i]), RoutedExpertTrace()
        loss_mask, rollout_logp = [0.0] * len(tokens), [0.0] * len(tokens)
        for turn in range(TURNS):
            if turn:  # the environment answers; its tokens are context, not trained on
                answer = tool_answers[i][turn - 1]
                tokens, loss_mask, rollout_logp = tokens + answer, loss_mask + [0.0] * 4, rollout_logp + [0.0] * 4
            result = await client.generate(
                tokens, {"max_new_tokens": NEW_TOKENS, "seed": 10 * i + turn},
                return_routed_experts=True, routed_experts_prompt_start=trace.prompt_start,
            )  # fmt: skip
            trace.record_result(result, prompt_len=len(tokens), prompt_ids=tokens)  # refuses mixed weight versions
            tokens += result.response_ids
            loss_mask += [1.0] * len(result.response_ids)
            rollout_logp += result.response_logprobs
        generated = np.array(tokens)[np.array(loss_mask) > 0]
        return {
            "input_ids": tokens,
            "routes": trace.finalize(token_count=len(tokens)),  # the last token has no route: never run forward
            "loss_mask": np.array(loss_mask, np.float32),
            "rollout_logprobs": np.array(rollout_logp, np.float32),
            "reward": float((generated % 2 == 0).mean()),  # a toy task: say even tokens
        }

    # The routing shape makes the client check every route it decodes before the trace sees it.
    async with RemoteGenerateClient(
        url, num_layers=engine.num_layers, topk=engine.topk, num_experts=engine.num_experts
    ) as client:
        samples = await asyncio.gather(*(one(client, i) for i in range(PROMPTS)))
    baseline = np.mean([s["reward"] for s in samples])  # group baseline, as in GRPO
    return [{**s, "advantage": np.float32(s["reward"] - baseline)} for s in samples]


def token_logprobs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, `[B, T - 1]` in fp32."""
    att = batch["attention_mask"]
    positions = (att.cumsum(1) - 1).clamp(min=0)  # left padding: count from each trajectory's first token
    logits = model(input_ids=batch["input_ids"], attention_mask=att, position_ids=positions).logits
    return logits.float().log_softmax(-1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


def run(policy: torch.nn.Module, batches: list[dict], hook: ReplayHook | None, optimizer=None) -> dict:
    """Score (and, given an optimizer, train on) every microbatch; figures over the captured tokens."""
    used: list[torch.Tensor] = []  # the experts each router hands its MoE block, in layer order
    # Registered after ReplayHook's hooks, so these see the choice the experts really get.
    gates = [module for name, module in policy.named_modules() if name.endswith(".mlp.gate")]
    spies = [gate.register_forward_hook(lambda m, a, out: used.append(out[2])) for gate in gates]
    agree, captured_tokens, gap, loss_tokens = torch.zeros(len(spies)), 0, 0.0, 0
    try:
        with hook.step() if hook else contextlib.nullcontext(), torch.set_grad_enabled(optimizer is not None):
            for batch in batches:
                used.clear()
                with hook.replay(batch) if hook else contextlib.nullcontext():
                    logp = token_logprobs(policy, batch)
                captured, routes = ~batch[ROUTER_MASK], batch[ROUTES].long()
                for layer, experts in enumerate(used):  # as sets: engines order the K experts freely
                    rollout_set = routes[:, :, layer].sort(-1).values
                    same = (experts.view(rollout_set.shape).sort(-1).values == rollout_set).all(-1)
                    agree[layer] += (same & captured).sum()
                captured_tokens += int(captured.sum())
                mask, old = batch["loss_mask"][:, 1:], batch["rollout_logprobs"][:, 1:]
                gap += float(((logp.detach() - old).abs() * mask).sum())
                loss_tokens += int(mask.sum())
                if optimizer is not None:
                    ratio = torch.exp(logp - old)  # importance weight against the policy that sampled
                    k3 = torch.exp(old - logp) - (old - logp) - 1  # non-negative estimate of the KL to it
                    mb_loss = ((-batch["advantage"][:, None] * ratio + 0.1 * k3) * mask).sum() / mask.sum()
                    (mb_loss / len(batches)).backward()
    finally:
        for spy in spies:
            spy.remove()
    figures = {"agreement": (agree / captured_tokens).tolist(), "gap": gap / loss_tokens}
    if optimizer is not None:  # replay recomputes the weights of the replayed experts from live logits
        figures["router_grad"] = float(torch.stack([gate.weight.grad.norm() for gate in gates]).norm())
        optimizer.step()
        optimizer.zero_grad()
    return figures


def main() -> None:
    policy, engine_model = build_models()
    engine = Bf16Engine(engine_model)
    with LoopbackServer(engine) as server:
        samples = asyncio.run(rollout(server.url, engine))
    collator = R3Collator(pad_token_id=PAD, pad_keys={"loss_mask": 0.0, "rollout_logprobs": 0.0})
    # Collation runs in worker processes, off the training loop; the same batches are scored twice.
    batches = list(DataLoader(samples, batch_size=4, collate_fn=collator, num_workers=2))
    print(f"{len(samples)} trajectories, {TURNS} turns each, in {len(batches)} microbatches")
    without = run(policy, batches, hook=None)  # scored only: the step below trains with replay
    hook = ReplayHook(policy)
    replayed = run(policy, batches, hook, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3))
    stats = hook.last_stats
    hook.close()
    a, b = replayed["agreement"], without["agreement"]
    print(f"{'':36}{'with replay':>12}{'without':>12}")
    print(f"{'route agreement on captured tokens':36}{sum(a) / len(a):>12.2%}{sum(b) / len(b):>12.2%}")
    for layer in range(len(a)):
        print(f"{f'  layer {layer}':36}{a[layer]:>12.2%}{b[layer]:>12.2%}")
    print(f"{'mean |logp_train - logp_rollout|':36}{replayed['gap']:>12.5f}{without['gap']:>12.5f}")
    # The fp32 routers' own choice against the rollout's, measured by the hook during the replayed step.
    print("hook.last_stats route drift per layer:", " ".join(f"{d:.2%}" for _, d in sorted(stats.route_drift.items())))
    print(f"hook.last_stats tokens: {stats.tokens}")
    print(f"one AdamW step with replay; router gradient norm {replayed['router_grad']:.3g}")


if __name__ == "__main__":
    main()
