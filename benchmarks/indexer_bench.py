"""DSA indexer selections: how small the compact form is, and how fast a long trajectory decodes and collates.

Selections come from real indexers (`torch_r3.testing.IndexerLM`: `transformers`' `DeepseekV32Indexer`,
random weights, chunked prefill) over two inputs: uniform random tokens, and text (the bytes of this
repository's documentation, cycled). For each, the compact form's bytes per token are printed beside
SGLang's dense int32 (`layers * index_topk * 4`).

Then, on the text capture, median over interleaved rounds (the machine may be shared: say so with the figures):

* `wire decode`: SGLang's base64 `meta_info.indexer_topk` -> `IndexerSelections` (checked, encoded);
* `collate`: `collate_selections([sel], [n])` -> the `[1, n, L, K]` int16 batch tensor (decode + shift);
* `copy floor`: a fresh `[n, L, K]` int16 buffer filled by one copy of an already decoded array: what
  any collation must at least pay for writing the output;
* `collate int32`: the same with `dtype=torch.int32`, the dense dtype SGLang sends;
* `memcpy int32`: the routes benchmarks' floor (`torch-r3 bench`'s `memcpy limit`): a warm copy of as many
  bytes as the int32 output into a buffer that already exists, split over as many threads as the
  collation's pool. `x memcpy int32` divides by it;
* `b64 floor`: `binascii.a2b_base64` of the payload alone.

Last (`--hook-only`: alone), it measures the DSA replay hook
(`torch_r3.transformers.IndexerReplayHook`) on a tiny random `transformers` DeepSeek-V3.2 model:
the bytes of the tensors the hook's own code creates and keeps (`torch_r3.bench.tensor_memory`,
counted op by op, not timed), against the compact bytes of the selections it replays: what it
keeps through the block, the peak of its checks on entry, and the peak over one forward.

    PYTHONPATH=. python benchmarks/indexer_bench.py                 # 32k tokens, 2 layers, top-2048
    PYTHONPATH=. python benchmarks/indexer_bench.py --tokens 8192 --rounds 3 --json out.json
    PYTHONPATH=. python benchmarks/indexer_bench.py --capture cap.npy   # reuse (or save) the capture
    PYTHONPATH=. python benchmarks/indexer_bench.py --hook-only          # the replay hook's memory only
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from torch_r3 import BufferPool, Memory
from torch_r3.bench.strategies import parallel_copy
from torch_r3.collate.selections import SELECTIONS, collate_selections
from torch_r3.cpu import pool_workers
from torch_r3.indexer import IndexerSelections
from torch_r3.rollout.selections_wire import decode_sglang_indexer_topk
from torch_r3.testing.indexer import IndexerLM

ROOT = Path(__file__).resolve().parents[1]


def text_tokens(n: int) -> np.ndarray:
    docs = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").rglob("*.md")))
    reps = -(-n // len(docs))
    return np.frombuffer(docs * reps, dtype=np.uint8)[:n].astype(np.int64)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def hook_memory(seq_len: int, layers: int, topk: int) -> dict:
    """The transformers DSA replay hook's extra tensor memory against the compact selections' bytes."""
    import transformers as tf

    from torch_r3.bench.tensor_memory import TensorMemory
    from torch_r3.transformers.indexer import IndexerReplayHook

    config = tf.DeepseekV32Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
        num_hidden_layers=layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=layers,  # dense layers: the indexers are what is measured
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=topk,
        index_n_heads=2,
        index_head_dim=16,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    lengths = (seq_len, seq_len * 3 // 4)
    ids = torch.randint(3, 64, (len(lengths), seq_len))
    att = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        att[b, seq_len - n :] = 1
    hook = IndexerReplayHook(model)
    with torch.no_grad(), hook.record() as rec:
        model(input_ids=ids, attention_mask=att)
    batch = rec.batch
    meter = TensorMemory()
    for m in model.modules():
        if type(m).__name__.endswith("Indexer"):  # around the hook's own forward hook
            m.register_forward_hook(lambda *a: meter.start(), prepend=True)
            m.register_forward_hook(lambda *a: meter.stop())
    block = hook.replay(batch)
    with torch.no_grad():
        with meter.counting():
            block.__enter__()
        kept, entry_peak = meter.live, meter.peak
        meter.peak = kept
        model(input_ids=ids, attention_mask=att)
        forward_peak = meter.peak
        block.__exit__(None, None, None)
    compact = batch[SELECTIONS].nbytes
    B, T, L, K = batch[SELECTIONS].shape
    out = {
        "shape": [B, T, L, K],
        "dtype": str(batch[SELECTIONS].dtype),
        "compact_bytes": compact,
        "kept_bytes": kept,
        "entry_peak_bytes": entry_peak,
        "forward_peak_bytes": forward_peak,
    }
    print(f"\nthe DSA replay hook's extra tensor memory, selections {[B, T, L, K]} {batch[SELECTIONS].dtype}:")
    print(f"{'':34} {'bytes':>12} {'x compact':>10}")
    for name, value in (
        ("compact selections", compact),
        ("kept through the replay() block", kept),
        ("peak on entry (checks)", entry_peak),
        ("peak over one forward", forward_peak),
    ):
        print(f"{name:34} {value:12d} {value / compact:10.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--capture", type=Path, default=None, help="an .npz of the captures: read if it exists, else written"
    )
    ap.add_argument("--hook-only", action="store_true", help="only the replay hook's memory (--hook-memory)")
    ap.add_argument("--hook-seq-len", type=int, default=1024)
    ap.add_argument("--hook-topk", type=int, default=64)
    args = ap.parse_args()
    n, L, K = args.tokens, args.layers, args.topk
    if args.hook_only:
        memory = hook_memory(args.hook_seq_len, L, args.hook_topk)
        if args.json:
            args.json.write_text(json.dumps({"hook_memory": memory}, indent=2))
        return
    lm = IndexerLM(num_layers=L, index_topk=K)
    inputs = {"random": np.random.default_rng(0).integers(0, 256, n), "text": text_tokens(n)}
    report: dict = {"tokens": n, "layers": L, "index_topk": K, "compression": {}, "timings_s": {}}
    print(f"selections of {n} tokens, {L} indexer layers, index_topk={K} (real DeepseekV32Indexer, random weights)")
    print(f"{'input':8} {'dense int32 B/token':>20} {'compact B/token':>16} {'ratio':>7} {'B/token/layer':>14}")
    dense = {}
    saved = dict(np.load(args.capture)) if args.capture is not None and args.capture.exists() else {}
    for kind, tokens in inputs.items():
        t = time.perf_counter()
        if kind in saved and saved[kind].shape == (n - 1, L, K):
            dense[kind] = saved[kind]
        else:
            dense[kind] = lm.select(tokens)[:-1]  # the engine's rows: seqlen - 1
        sel = IndexerSelections.from_dense(dense[kind])
        rows = sel.rows
        per_token, int32 = sel.nbytes / rows, sel.dense_nbytes / rows
        report["compression"][kind] = {"bytes_per_token": per_token, "int32_bytes_per_token": int32}
        print(
            f"{kind:8} {int32:20.0f} {per_token:16.1f} {int32 / per_token:7.1f} {per_token / L:14.1f}"
            f"   (capture {time.perf_counter() - t:.1f} s)"
        )
    if args.capture is not None and not saved:
        np.savez(args.capture, **dense)
    d = dense["text"]
    payload = base64.b64encode(d.astype("<i4").tobytes()).decode()
    sel = IndexerSelections.from_dense(d)
    decoded16 = sel.to_dense(np.int16)
    decoded32 = decoded16.astype(np.int32)
    workers = pool_workers() if args.workers is None else args.workers
    plain = BufferPool(cache_bytes=0)
    floor_src = decoded32.reshape(-1).view(np.uint8)
    floor_dst = plain.empty((floor_src.size,), torch.uint8).numpy()
    floor_dst[:] = 1  # warm: the floor pays no page faults
    copy_pool = ThreadPoolExecutor(workers - 1) if workers > 1 else None
    stages = ("wire decode", "collate", "copy floor", "collate int32", "memcpy int32", "b64 floor")
    rounds: dict[str, list[float]] = {k: [] for k in stages}
    want32 = None
    want = None
    for _ in range(args.rounds):  # interleaved: each round runs every stage once
        rounds["wire decode"].append(
            timed(lambda: decode_sglang_indexer_topk(payload, num_layers=L, index_topk=K, max_bytes=1 << 40))
        )
        out: dict = {}

        def collate(out: dict = out) -> None:
            out.update(collate_selections([sel], [d.shape[0] + 1], memory=Memory(workers=args.workers)))

        rounds["collate"].append(timed(collate))
        want = out[SELECTIONS]
        rounds["copy floor"].append(timed(lambda: np.copyto(np.empty_like(decoded16), decoded16)))
        out32: dict = {}

        def collate32(out: dict = out32) -> None:
            out.update(
                collate_selections([sel], [d.shape[0] + 1], memory=Memory(workers=args.workers), dtype=torch.int32)
            )

        rounds["collate int32"].append(timed(collate32))
        want32 = out32[SELECTIONS]
        rounds["memcpy int32"].append(timed(lambda: parallel_copy(floor_dst, floor_src, workers, copy_pool)))
        rounds["b64 floor"].append(timed(lambda: binascii.a2b_base64(payload)))
    if copy_pool is not None:
        copy_pool.shutdown()
    assert want is not None and np.array_equal(want.numpy()[0, :-1], decoded16)  # the batch is the decoded capture
    assert want32 is not None and np.array_equal(want32.numpy()[0, :-1], decoded32)
    out_mb = decoded16.nbytes / 1e6
    print(
        f"\none {n}-token trajectory, text input; median of {args.rounds} interleaved rounds "
        "(a shared machine: figures vary with load)"
    )
    print(f"{'stage':14} {'seconds':>9} {'x copy floor':>13} {'x memcpy int32':>15} {'output MB/s':>12}")
    floor = statistics.median(rounds["copy floor"])
    floor32 = statistics.median(rounds["memcpy int32"])
    for stage, times in rounds.items():
        med = statistics.median(times)
        report["timings_s"][stage] = med
        mb = 2 * out_mb if "int32" in stage else out_mb
        print(f"{stage:14} {med:9.3f} {med / floor:13.1f} {med / floor32:15.1f} {mb / med:12.0f}")
    report["collate_int32_vs_memcpy"] = statistics.median(rounds["collate int32"]) / floor32
    report["workers"] = workers
    print(f"({workers} threads for collation and the memcpy floor)")
    print(
        f"(payload {len(payload) / 1e6:.0f} MB of base64, compact {sel.nbytes / 1e6:.1f} MB, "
        f"int16 output {out_mb:.0f} MB)"
    )
    report["hook_memory"] = hook_memory(args.hook_seq_len, L, args.hook_topk)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
