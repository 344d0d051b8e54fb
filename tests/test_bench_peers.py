"""The peers' collations of `benchmarks/peers.py` and `python -m benchmarks.compare`, which times them.

They live in the checkout, not in the package: importing `benchmarks.peers`
registers them into `torch_r3.bench`. Each is compared with the plain
position-by-position reference collator, independent of torch_r3.collate, as
torch_r3's own strategies are in `tests/test_bench.py`. Shapes are tiny and no
timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import compare, peers
from tests.reference_collate import assert_batch_equal, reference_packed, reference_padded
from torch_r3 import bench
from torch_r3.bench import strategies

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_sequences=6, max_seqlen=40, num_layers=3, topk=2, repeats=1)
TINY_ARGS = ["--num-sequences", "4", "--max-seqlen", "24", "--num-layers", "2", "--topk", "2", "--repeats", "1"]
PEER_NAMES = [p.name for p in peers.PEERS]


def test_importing_the_peers_registers_them_beside_torch_r3_s_own_not_among_them():
    assert PEER_NAMES == [peers.BASELINE, peers.SKYRL_PADDED, peers.SKYRL_PACKED, peers.PAD_SEQUENCE]
    assert all(bench.registered()[p.name] is p for p in peers.PEERS)
    assert not set(PEER_NAMES) & set(bench.STRATEGIES)
    assert sorted(peers.COMPARE_ORDER) == sorted([*bench.STRATEGIES, *PEER_NAMES])


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(distribution="typical_rl"),
        dict(distribution="heavy_tail", mixed_dtypes=True),
        dict(distribution="mild_ragged", num_experts=300, topk=3),
    ],
    ids=["uniform", "typical_rl", "heavy_tail-mixed", "int16"],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_every_peer_matches_the_plain_reference(shape, workers):
    batch = bench.make_batch(bench.BenchConfig(**{**TINY, **shape}))
    padded = reference_padded(batch.routes, batch.token_counts)
    packed = reference_packed(batch.routes, batch.token_counts)
    for name in PEER_NAMES:
        out = bench.run_strategy(name, batch, workers=workers)
        assert_batch_equal(out, packed if strategies.get_strategy(name).layout == "packed" else padded)


def test_pad_sequence_matches_the_reference_past_the_pool_threshold():
    batch = bench.make_batch(bench.BenchConfig(num_sequences=8, max_seqlen=2048, num_layers=40, topk=8))
    assert_batch_equal(
        bench.run_strategy(peers.PAD_SEQUENCE, batch, workers=2), reference_padded(batch.routes, batch.token_counts)
    )


def test_the_side_by_side_run_checks_everything_against_the_baseline_and_times_the_speed_up_over_it():
    result = bench.run_shape(bench.BenchConfig(**{**TINY, "repeats": 2}), peers.COMPARE_ORDER, None, peers.BASELINE)
    assert [s.name for s in result.strategies] == list(peers.COMPARE_ORDER)
    assert result.speedup_over == peers.BASELINE
    baseline = result.get(peers.BASELINE)
    for s in result.strategies:
        assert len(s.times_s) == 2 and s.min_s <= s.median_s <= s.max_s
        assert s.speedup == pytest.approx(baseline.median_s / s.median_s)
        if s.name == peers.BASELINE:
            assert s.checked_against is None and s.speedup == 1.0
        elif s.name != bench.MEMCPY:
            assert s.checked_against == peers.BASELINE
    assert "vs baseline" in bench.format_table(result).splitlines()[0]


def test_a_fresh_output_s_peak_memory_counts_the_whole_output():
    # Strategies run one after another in one process: memory the previous ones
    # freed is still resident in the C allocator, and a fresh output must not look free.
    config = bench.BenchConfig(num_sequences=8, max_seqlen=4096, num_layers=40, topk=8, repeats=1)
    names = [peers.BASELINE, bench.SERIAL, bench.FRESH, bench.PACKED, peers.PAD_SEQUENCE]
    shape = bench.run_shape(config, names)
    for name in names:
        s = shape.get(name)
        written = shape.packed_bytes if name == bench.PACKED else shape.padded_bytes
        assert s.peak_extra_bytes >= 0.95 * written, (name, s.peak_extra_bytes, written)
        assert 0.95 <= s.peak_ratio, (name, s.peak_ratio)


def test_compare_is_torch_r3_bench_with_the_peers_the_baseline_first(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert compare.main([*TINY_ARGS, "--no-progress", "--no-packed-compare", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch-r3 bench" in out and "vs baseline" in out and "SkyRL-style packed" in out
    main = json.loads(path.read_text())["main"]
    assert [s["name"] for s in main["strategies"]] == list(peers.COMPARE_ORDER)
    assert main["speedup_over"] == peers.BASELINE and main["strategies"][0]["speedup"] == 1.0
    # Options given to it override its defaults.
    args = [*TINY_ARGS, "--no-progress", "--no-packed-compare", "--json", str(path)]
    assert compare.main([*args, "--strategies", "pad_sequence,torch_r3 fresh", "--speedup-over", "torch_r3 fresh"]) == 0
    main = json.loads(path.read_text())["main"]
    assert [s["name"] for s in main["strategies"]] == [peers.PAD_SEQUENCE, bench.FRESH]
    assert main["speedup_over"] == bench.FRESH


def test_compare_runs_as_a_module_of_the_checkout():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "--speedup-over" in done.stdout and "SkyRL-style padded" in done.stdout


def test_check_targets_loads_the_checkout_s_benchmarks_by_path_where_they_are_not_importable(tmp_path):
    # An installed (editable) torch_r3 run from elsewhere: the checkout's root is not on sys.path.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import torch_r3.bench\n"
        "sys.path.pop(0)\n"
        "from torch_r3.bench.checkout import load_targets\n"
        "targets = load_targets()\n"
        "print(sys.modules['benchmarks'].__path__[0], targets.SPEEDUP_OVER in torch_r3.bench.registered())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "benchmarks"), "True"]


def test_check_targets_refuses_another_package_named_benchmarks(monkeypatch, capsys, tmp_path):
    from torch_r3 import cli
    from torch_r3.bench import checkout

    other = types.ModuleType("benchmarks")
    other.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "benchmarks", other)
    monkeypatch.delitem(sys.modules, checkout.TARGETS_MODULE, raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--check-targets", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"another package named 'benchmarks' is imported ({tmp_path})" in err and err.count("\n") == 1
