"""What ReplayHook's per-microbatch work costs on the CPU (route checks, live routing).

1. `check_route_values` alone on a production-sized microbatch
   (`[B, T, L, K]` uint8 routes, every position captured).
2. A training step (`forward_backward`, full recompute) of a small MoE GPTModel
   with the hook, `uncaptured="live"` and `"replay"`, against the time the
   route check takes for the same microbatches.

Usage: python benchmarks/replay_overhead.py [--repeat 7] [--threads 1]
Medians of `--repeat` runs; run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_alone(repeat: int) -> None:
    from torch_r3.megatron import check_route_values

    for b, t, layers, k, experts in ((8, 4096, 48, 8, 128), (4, 8192, 61, 8, 256)):
        routes = torch.argsort(torch.rand(b, t, layers, experts), -1)[..., :k].to(torch.uint8)
        checked = torch.ones(b, t, dtype=torch.bool)
        index = [(i, i) for i in range(layers)]
        # B023: each lambda is called inside `_median_seconds` within this iteration, never after it.
        s = _median_seconds(lambda: check_route_values(routes, checked, index, experts, microbatch=0), repeat)  # noqa: B023
        widen = _median_seconds(lambda: routes.to(torch.int64), repeat)  # noqa: B023  # what the hook copies anyway
        mib = routes.numel() / 2**20
        print(
            f"check_route_values [{b}, {t}, {layers}, {k}] uint8 ({mib:.0f} MiB): {s * 1e3:.1f} ms "
            f"(widening the same routes to int64: {widen * 1e3:.1f} ms)"
        )


def step_with_hook(repeat: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from torch_r3.megatron import ReplayHook, check_route_values
    from torch_r3.megatron._cpu import megatron_on_cpu

    # a world of one: an in-process store, no probed TCP port to lose to another process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    b, t, layers, experts, k, vocab, m = 4, 256, 4, 8, 2, 128, 4
    with megatron_on_cpu():
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=64,
            num_attention_heads=4,
            num_moe_experts=experts,
            moe_router_topk=k,
            moe_token_dispatcher_type="allgather",
            moe_enable_routing_replay=True,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            add_bias_linear=False,
            pipeline_dtype=torch.float32,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        )
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=t)
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(m):
            mask = torch.zeros(b, t, dtype=torch.bool)
            mask[:, :16] = True  # left padding
            batches.append(
                {
                    "input_ids": torch.randint(0, vocab, (b, t), generator=g),
                    "rollout_expert_indices": torch.argsort(torch.rand(b, t, layers, experts, generator=g), -1)[
                        ..., :k
                    ].to(torch.uint8),
                    "router_padding_mask": mask,
                }
            )

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            ids = batch["input_ids"]
            out = model(ids, torch.arange(t).expand(b, t), None, labels=ids)
            return out, lambda o: (o.float().mean(), {})

        def run(hook):
            hook.forward_backward(
                get_forward_backward_func(),
                forward_step_func=forward_step,
                data_iterator=iter(batches),
                model=[model],
                num_microbatches=m,
                seq_length=t,
                micro_batch_size=b,
            )

        index = [(i, i) for i in range(layers)]
        checks = _median_seconds(
            lambda: [
                check_route_values(x["rollout_expert_indices"], ~x["router_padding_mask"], index, experts, microbatch=0)
                for x in batches
            ],
            repeat,
        )
        for uncaptured in ("live", "replay"):
            with ReplayHook(model, uncaptured=uncaptured) as hook:
                s = _median_seconds(lambda: run(hook), repeat)
            print(
                f"step ({m} microbatches of [{b}, {t}], {layers} MoE layers, uncaptured={uncaptured!r}): "
                f"{s * 1e3:.0f} ms; of it the route checks: {checks * 1e3:.2f} ms ({100 * checks / s:.2f}%)"
            )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    check_alone(args.repeat)
    step_with_hook(args.repeat)


if __name__ == "__main__":
    main()
