"""How much of the engine-trainer log-prob gap indexer replay removes, on a tiny DSA MoE model.

The "engine" is a `transformers` DeepSeek-V3.2 (or GLM-MoE-DSA) model in bf16; the "trainer" is the
same weights in fp32. The engine's own choices (routes and indexer selections) are recorded with
`DSAReplayHook.record()` in bf16, as an inference engine would capture them; the trainer then runs
with no replay, with routes only, with selections only, and with both. Printed: the mean and max
|log p_engine - log p_trainer| over the sampled tokens, and the share of indexer selections the
trainer's own indexers agree with.

    PYTHONPATH=. python benchmarks/dsa_logprob_cut.py                  # deepseek_v32, 4 x 256 tokens
    PYTHONPATH=. python benchmarks/dsa_logprob_cut.py --family glm_moe_dsa --tokens 512
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch

from torch_r3.collate.selections import SELECTIONS
from torch_r3.transformers import ReplayHook
from torch_r3.transformers.indexer import DSAReplayHook, IndexerReplayHook


def build(family: str, topk: int, seed: int) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=512, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=4096, num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=2,
        moe_intermediate_size=64, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, index_topk=topk, index_n_heads=4, index_head_dim=32,
    )  # fmt: skip
    config = (
        tf.GlmMoeDsaConfig(**common, index_topk_freq=2) if family == "glm_moe_dsa" else tf.DeepseekV32Config(**common)
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model.eval()


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="deepseek_v32", choices=["deepseek_v32", "glm_moe_dsa"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--index-topk", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trainer = build(args.family, args.index_topk, args.seed)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)
    ids = torch.randint(3, 512, (args.batch, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    hook_engine = DSAReplayHook(engine)
    with torch.no_grad(), hook_engine.record() as (routes, selections):
        engine_lp = token_logprobs(engine, ids)
    hook_engine.close()
    batch = {**routes.batch, **selections.batch, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    print(
        f"{args.family}: {args.batch} x {args.tokens} tokens, index_topk={args.index_topk}; "
        "engine bf16, trainer fp32, same weights"
    )
    print(f"{'trainer replays':22} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'selection overlap':>18}")
    runs = {
        "nothing": [],
        "routes": [ReplayHook],
        "indexer selections": [IndexerReplayHook],
        "routes + selections": [ReplayHook, IndexerReplayHook],
    }
    engine_sel = selections.batch[SELECTIONS]
    for label, hooks in runs.items():
        made = [h(trainer) for h in hooks]
        indexer = next((h for h in made if isinstance(h, IndexerReplayHook)), None)
        with contextlib.ExitStack() as stack, torch.no_grad():
            for h in made:
                stack.enter_context(h.replay(batch))
            probe = None
            if indexer is None:  # record the trainer's own selections to compare them with the engine's
                probe = IndexerReplayHook(trainer)
                rec = stack.enter_context(probe.record())
            lp = token_logprobs(trainer, ids)
        if indexer is not None:
            agree = indexer.last_stats.mean_overlap  # type: ignore[union-attr]
        else:
            agree = overlap(rec.batch[SELECTIONS], engine_sel)
            probe.close()  # type: ignore[union-attr]
        gap = (lp - engine_lp).abs()
        print(f"{label:22} {gap.mean().item():13.5f} {gap.max().item():12.5f} {agree:18.4f}")
        for h in made:
            h.close()


def overlap(own: torch.Tensor, engine: torch.Tensor) -> float:
    """Mean share of the engine's selected positions the trainer also selected (rows with any)."""
    own, engine = own.long(), engine.long()
    hit = ((own[..., :, None] == engine[..., None, :]) & (engine[..., None, :] >= 0)).any(-2).sum(-1)
    n = (engine >= 0).sum(-1)
    rows = n > 0
    return float((hit[rows] / n[rows]).mean())


if __name__ == "__main__":
    main()
