"""One rank of the multi-rank tests: DDP or FSDP2 training steps with ReplayHook, in a spawned process.

Run as `python hf_mr_worker.py <modes> <rank> <world> <port> <out>`, `<modes>` one or
more of `ddp`, `fsdp2` joined by commas, each run in turn on a fresh model in the same
process group; rank 0 writes each mode's losses and updated parameters to
`<out>/<mode>.pt`.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.samples import route_samples
from tests.transformers.hf_models import build

FAMILY = "qwen3_moe"
STEPS = 2
BATCH = 2  # per rank


def samples(n=8, seed=5):
    """Trajectories with routes for every decoder layer (dense layer 1 as zero rows), the last token uncaptured."""
    model = build(FAMILY)
    layers, topk, experts = model.config.num_hidden_layers, model.config.num_experts_per_tok, model.config.num_experts
    moe = [0, 2]  # mlp_only_layers=[1] in the tiny config
    return route_samples(
        seed,
        n=n,
        min_tokens=3,
        max_tokens=7,
        captured="all_but_last",
        num_layers=layers,
        topk=topk,
        num_experts=experts,
        moe_layers=moe,
        token_ids=(3, 64),
    )


def loss_of(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    real = batch["attention_mask"][:, 1:].bool()
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(logp * real).sum() / (BATCH * 8)  # a fixed normaliser: the ranks' mean is the global loss


def main(modes: str, rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for mode in modes.split(","):
        train(mode, rank, world, os.path.join(out, f"{mode}.pt"))
    dist.destroy_process_group()


def train(mode: str, rank: int, world: int, out: str) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from torch_r3 import R3Collator
    from torch_r3.transformers import ReplayHook

    model = build(FAMILY).train()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        model.activation_checkpointing_enable()
        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    hook = ReplayHook(wrapped)
    optim = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    data = samples()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, collate_fn=R3Collator(pad_token_id=0), num_workers=1)
    losses = []
    for batch in loader:
        with hook.replay(batch):
            loss = loss_of(wrapped, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        assert hook.last_stats.tokens.captured == int((~batch["router_padding_mask"]).sum())
    params = {}
    for name, p in wrapped.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        params[name.removeprefix("module.")] = full.detach().clone()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
