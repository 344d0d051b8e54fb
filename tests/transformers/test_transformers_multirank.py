"""DDP and FSDP2 over two spawned gloo ranks, each exact against a single-process run.

Both ranks run `hf_mr_worker.py`: a DataLoader with `DistributedSampler` and
`R3Collator`, `ReplayHook` on the wrapped model, two SGD steps. The reference
runs in this process, on the same weights and the same per-rank batches: the
mean of the ranks' losses, one backward, one step, as data parallelism means.
FSDP2 (`fully_shard` per decoder layer and at the root) runs on CPU with gloo,
with activation checkpointing on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.transformers.hf_models import build
from tests.transformers.hf_mr_worker import BATCH, STEPS, loss_of, samples
from torch_r3 import R3Collator
from torch_r3.transformers import ReplayHook

pytestmark = pytest.mark.slow
WORLD = 2
HERE = Path(__file__).resolve().parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One pair of spawned ranks trains every mode in turn (one start-up, one process group)."""
    out = tmp_path_factory.mktemp("ranks")
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "hf_mr_worker.py"), ",".join(MODES), str(r), str(WORLD), str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return out


def _single_process(checkpointing: bool) -> dict:
    model = build("qwen3_moe").train()
    if checkpointing:
        model.activation_checkpointing_enable()
    hook = ReplayHook(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    data = samples()
    collate = R3Collator(pad_token_id=0)
    losses = []
    # DistributedSampler(shuffle=False) gives rank r the samples r, r + WORLD, ...; batch s of rank r:
    per_rank = [data[r::WORLD] for r in range(WORLD)]
    for step in range(STEPS):
        total = 0.0
        for r in range(WORLD):
            batch = collate(per_rank[r][step * BATCH : (step + 1) * BATCH])
            with hook.replay(batch):
                loss = loss_of(model, batch) / WORLD
            loss.backward()
            total += loss.item()
        optim.step()
        optim.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_train_exactly_like_one_process(mode, two_ranks):
    got = torch.load(two_ranks / f"{mode}.pt")
    want = _single_process(checkpointing=mode == "fsdp2")
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)
    initial = dict(build("qwen3_moe").named_parameters())
    routers = [n for n in want["params"] if n.endswith(".mlp.gate.weight")]
    assert len(routers) == 2 and all(not torch.equal(want["params"][n], initial[n]) for n in routers)
