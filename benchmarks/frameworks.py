"""SkyRL 0.4.0's and verl 0.9.1's own route collation beside `torch_r3.integrations`, in one process.

Run it where the trainers are installed (`make frameworks` builds `.venv-frameworks`):

    PYTHONPATH=. .venv-frameworks/bin/python benchmarks/frameworks.py [--batch 192] [--rounds 5]

* SkyRL, packed (its controller): `preprocess._collate_rollout_expert_indices`
  against `torch_r3.integrations.skyrl.collate_rollout_expert_indices`, fresh
  and with a `BufferPool`.
* SkyRL, padded (its Megatron worker, `remove_microbatch_padding=False`): its
  `align_packed_token_metadata` + `align_token_metadata` of one micro-batch
  against `torch_r3.integrations.skyrl.microbatch`.
* verl (its agent loop, then its driver): a zero-filled int16 `[1, P + R, L, K]`
  per sample (the agent loop's three tensor operations: zeros, one slice copy,
  `torch.cat` of the batch), then verl's own `left_right_2_no_padding`, against
  `torch_r3.integrations.verl.nested_routed_experts` from the compact samples.

Every output is checked equal to the framework's before timing counts. After
one warm-up round the cases run in interleaved rounds (each once per round) and the table gives
medians: on a loaded machine, read the ratios, not the absolute figures. SkyRL's
and verl's modules are loaded behind bare parent packages, as the tests load them
(`tests/integrations/frameworks.py`). A framework that is not installed is skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torch_r3 import Memory, PromptResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from frameworks import installed, load

from torch_r3 import BufferPool

L, K, EXPERTS = 40, 8, 128


def rl_lengths(batch: int, prompt: int, response: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt // 4, prompt + 1, batch).tolist()
    responses = np.clip(rng.lognormal(np.log(response / 3), 0.7, batch), 8, response).astype(int).tolist()
    return prompts, responses


def routes_for(prompts, responses, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, EXPERTS, (p + r - 1, L, K), dtype=np.uint8) for p, r in zip(prompts, responses)]


def timed(cases: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # a warm-up round, not counted (first-touch page faults, pool fills)
        run()
    for _ in range(rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            out = run()
            times[name].append(time.perf_counter() - t0)
            del out
    return {name: statistics.median(t) for name, t in times.items()}


def report(title: str, medians: dict[str, float], nbytes: int, baseline: str) -> None:
    print(f"\n{title} ({nbytes / 1e6:.0f} MB of routes out)")
    print(f"{'':<52} {'median ms':>10} {'GB/s':>6} {'vs ' + baseline.split(':')[0]:>12}")
    for name, t in medians.items():
        print(f"{name:<52} {t * 1e3:>10.1f} {nbytes / t / 1e9:>6.2f} {medians[baseline] / t:>11.2f}x")


def skyrl(args) -> None:
    preprocess, metadata, replay = load(
        "skyrl",
        "skyrl.train.dataset.preprocess",
        "skyrl.backends.skyrl_train.distributed.megatron.token_metadata",
        "skyrl.backends.skyrl_train.utils.replay_utils",
    )
    from torch_r3.integrations import skyrl as integration

    prompts, responses = rl_lengths(args.batch, 1024, 4096)
    routes = routes_for(prompts, responses)
    total = np.asarray(prompts) + np.asarray(responses)
    pool = BufferPool()
    theirs = preprocess._collate_rollout_expert_indices(routes, total)
    ours = integration.collate_rollout_expert_indices(routes, total, memory=Memory(buffers=pool))
    assert torch.equal(theirs.values, ours.values) and torch.equal(theirs.cu_seqlens, ours.cu_seqlens)
    nbytes = theirs.values.nbytes
    del ours
    cases = {
        f"SkyRL {args.skyrl}: _collate_rollout_expert_indices": lambda: preprocess._collate_rollout_expert_indices(
            routes, total
        ),
        "torch_r3: collate_rollout_expert_indices": lambda: integration.collate_rollout_expert_indices(routes, total),
        "torch_r3: collate_rollout_expert_indices, BufferPool": lambda: integration.collate_rollout_expert_indices(
            routes, total, memory=Memory(buffers=pool)
        ),
    }
    report(
        f"SkyRL controller, packed: {args.batch} trajectories, {int(total.sum())} tokens, {L} layers x top-{K} uint8",
        timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )

    # One worker micro-batch, right-padded (remove_left_padding), from the controller's batch form.
    mb = slice(0, args.micro_batch)
    sub = theirs[mb]
    n = total[mb]
    t = int(n.max())
    attention = torch.zeros(len(n), t, dtype=torch.long)
    for i, k in enumerate(n.tolist()):
        attention[i, t - k :] = 1
    mask = preprocess.make_router_padding_mask(attention, [len(r) for r in routes[mb]])
    batch = {
        "sequences": attention.clone(),
        "attention_mask": attention,
        "rollout_expert_indices": sub,
        "router_padding_mask": mask,
    }
    layout = metadata.canonical_token_metadata_layout(attention)
    filler = replay.replay_padding_row(K, dtype=sub.dtype)

    def skyrl_align():
        return (
            metadata.align_packed_token_metadata(sub, layout, filler),
            metadata.align_token_metadata(mask, layout, True),
        )

    worker_pool = BufferPool()
    ref = skyrl_align()
    got = integration.microbatch(batch, memory=Memory(buffers=worker_pool))
    assert torch.equal(ref[0], got["rollout_expert_indices"]) and torch.equal(ref[1], got["router_padding_mask"])
    nbytes = ref[0].nbytes
    del got
    cases = {
        f"SkyRL {args.skyrl}: align_(packed_)token_metadata": skyrl_align,
        "torch_r3: skyrl.microbatch, BufferPool": lambda: integration.microbatch(
            batch, memory=Memory(buffers=worker_pool)
        ),
    }
    report(
        f"SkyRL worker, right-padded micro-batch of {args.micro_batch}: [{args.micro_batch}, {t}, {L}, {K}]",
        timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )


def verl(args) -> None:
    (padding,) = load("verl", "verl.workers.utils.padding")
    from tensordict import TensorDict

    from torch_r3.integrations.verl import nested_routed_experts, padded_routed_experts

    P, R = 1024, 2048
    prompts, responses = rl_lengths(args.batch, P, R, seed=2)
    routes = routes_for(prompts, responses, seed=3)
    b = len(prompts)
    attention = torch.zeros(b, P + R, dtype=torch.long)
    response_mask = torch.zeros(b, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def agent_loop():
        per_sample = []
        for p, rows in zip(prompts, routes):  # the agent loop, per sample: zeros int16, one slice copy
            out = torch.zeros(1, P + R, L, K, dtype=torch.int16)
            out[:, P - p : P - p + rows.shape[0]] = torch.from_numpy(rows).to(torch.int16).unsqueeze(0)
            per_sample.append(out)
        return torch.cat(per_sample, 0)  # the driver's batch

    def verl_path():
        data = TensorDict(
            {
                "input_ids": attention.clone(),
                "attention_mask": attention,
                "response_mask": response_mask,
                "position_ids": positions,
                "routed_experts": agent_loop(),
            },
            batch_size=[b],
        )
        return padding.left_right_2_no_padding(data)["routed_experts"]

    counts = [p + r for p, r in zip(prompts, responses)]
    padded = padded_routed_experts(
        routes,
        prompts,
        responses,
        layout=PromptResponse(prompt_width=P, response_width=R),
    )
    assert torch.equal(agent_loop(), padded["rollout_expert_indices"])
    padded_bytes = padded["rollout_expert_indices"].nbytes
    del padded
    cases = {
        f"verl {args.verl}: agent loop zeros + slice copy, torch.cat": agent_loop,
        "torch_r3: verl.padded_routed_experts": lambda: padded_routed_experts(
            routes,
            prompts,
            responses,
            layout=PromptResponse(prompt_width=P, response_width=R),
        ),
    }
    report(
        f"verl agent loop to driver: {b} samples, P={P} R={R}, padded int16 [B, P + R, {L}, {K}] out",
        timed(cases, args.rounds),
        padded_bytes,
        next(iter(cases)),
    )
    theirs = verl_path()
    ours, _ = nested_routed_experts(routes, counts)
    assert torch.equal(theirs.values(), ours.values()) and torch.equal(theirs.offsets(), ours.offsets())
    nbytes = theirs.values().nbytes
    del theirs, ours
    cases = {
        f"verl {args.verl}: agent loop zeros + cat + left_right_2_no_padding": verl_path,
        "torch_r3: verl.nested_routed_experts": lambda: nested_routed_experts(routes, counts),
    }
    report(
        f"verl driver: {b} samples, P={P} R={R}, {sum(counts)} tokens, {L} layers x top-{K}, int16 nested out",
        timed(cases, args.rounds),
        nbytes,
        next(iter(cases)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (SkyRL's and verl's copies are torch ops; on a loaded 2-core machine "
        "2 threads made them up to 10x slower than 1, so 1, their best there, is the default)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    from importlib.metadata import version

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); one warm-up round, then "
        f"{args.rounds} interleaved rounds, medians (on a loaded machine: read the ratios)"
    )
    for name, run in (("skyrl", skyrl), ("verl", verl)):
        if not installed(name):
            print(f"\n{name}: not installed here, skipped (make frameworks builds .venv-frameworks with it)")
            continue
        setattr(args, name, version(name))
        run(args)


if __name__ == "__main__":
    main()
