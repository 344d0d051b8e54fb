"""The benchmark: its synthetic batches, its strategies, its checks, its report and its command line.

Every strategy is compared with a plain position-by-position reference
collator, independent of torch_r3.collate. Shapes are tiny and no timing is
asserted. The peers' collations, which live in the checkout
(`benchmarks/peers.py`), are specified in `tests/test_bench_peers.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.peers import BASELINE
from tests.reference_collate import assert_batch_equal, reference_packed, reference_padded, reference_r3_collator
from torch_r3 import bench, cli
from torch_r3.bench import memory, report, strategies
from torch_r3.bench.checkout import load_targets
from torch_r3.bench.reference import Reference
from torch_r3.cpu import cpu_topology

ROOT = Path(__file__).resolve().parents[1]
targets = load_targets()  # benchmarks/targets.py of this checkout
TINY = dict(num_sequences=6, max_seqlen=40, num_layers=3, topk=2, repeats=1)
TINY_ARGS = [
    "--num-sequences",
    "4",
    "--max-seqlen",
    "24",
    "--num-layers",
    "2",
    "--topk",
    "2",
    "--repeats",
    "1",
    "--no-progress",
]


@pytest.mark.parametrize("distribution", bench.DISTRIBUTIONS)
def test_lengths_stay_in_range_and_reach_the_named_mean(distribution):
    lengths = bench.sequence_lengths(distribution, 2048, 4096, np.random.default_rng(1))
    assert lengths.dtype == np.int64 and lengths.min() >= 1 and lengths.max() <= 4096
    want = {"uniform": 4096 / 2, "mild_ragged": 4096 / 2, "typical_rl": 4096 / 16, "heavy_tail": 4096 / 64}
    assert abs(lengths.mean() - want[distribution]) < 0.1 * want[distribution]
    if distribution != "uniform":
        assert lengths.max() == 4096  # a few rollouts hit the generation limit


def test_batch_rows_are_tokens_minus_one_and_a_few_eos_rows_are_tokens_minus_two():
    batch = bench.make_batch(bench.BenchConfig(num_sequences=64, max_seqlen=50, num_layers=2, topk=4))
    gaps = [n - r.shape[0] for r, n in zip(batch.routes, batch.token_counts)]
    assert set(gaps) <= {1, 2} and gaps.count(2) == 4  # one in 16 carries a synthetic EOS
    for r in batch.routes:
        assert r.dtype == np.uint8 and r.flags.c_contiguous
        assert (r < 128).all()
        assert all(len(set(row)) == 4 for row in r.reshape(-1, 4).tolist())  # K distinct experts


def test_the_batch_is_a_function_of_the_seed():
    a = bench.make_batch(bench.BenchConfig(**TINY, seed=3))
    b = bench.make_batch(bench.BenchConfig(**TINY, seed=3))
    c = bench.make_batch(bench.BenchConfig(**TINY, seed=4))
    assert a.token_counts == b.token_counts and all(np.array_equal(x, y) for x, y in zip(a.routes, b.routes))
    assert a.token_counts != c.token_counts


def test_mixed_dtypes_batch_holds_uint8_and_int16_senders():
    batch = bench.make_batch(bench.BenchConfig(**TINY, mixed_dtypes=True))
    assert {r.dtype for r in batch.routes} == {np.dtype(np.uint8), np.dtype(np.int16)}
    assert batch.dtype == np.int16


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
def test_every_strategy_matches_the_plain_reference(shape, workers):
    batch = bench.make_batch(bench.BenchConfig(**{**TINY, **shape}))
    padded = reference_padded(batch.routes, batch.token_counts)
    packed = reference_packed(batch.routes, batch.token_counts)
    for name in bench.STRATEGIES:
        out = bench.run_strategy(name, batch, workers=workers)
        if name == bench.MEMCPY:
            assert out is None
        else:
            assert_batch_equal(out, packed if strategies.get_strategy(name).layout == "packed" else padded)


def test_strategies_match_the_reference_past_the_pool_threshold():
    # Big enough (> 4 MiB of output) that torch_r3 really uses its pool.
    batch = bench.make_batch(bench.BenchConfig(num_sequences=8, max_seqlen=2048, num_layers=40, topk=8))
    want = reference_padded(batch.routes, batch.token_counts)
    for name in (bench.SERIAL, bench.FRESH, bench.REUSED):
        assert_batch_equal(bench.run_strategy(name, batch, workers=2), want)


def test_run_shape_checks_then_times_every_strategy():
    result = bench.run_shape(bench.BenchConfig(**{**TINY, "repeats": 2}))
    assert [s.name for s in result.strategies] == list(bench.STRATEGIES)
    assert result.speedup_over == bench.SERIAL  # torch_r3's kernel on one thread, the first strategy
    serial = result.get(bench.SERIAL)
    for s in result.strategies:
        assert len(s.times_s) == 2 and s.min_s <= s.median_s <= s.max_s
        assert s.speedup == pytest.approx(serial.median_s / s.median_s)
        if s.name == bench.SERIAL:
            assert s.checked_against is None and s.speedup == 1.0
        elif s.name != bench.MEMCPY:
            assert s.checked_against == bench.SERIAL
    assert result.get(bench.MEMCPY).ratio_to_memcpy == 1.0


def test_the_wheel_s_strategies_are_torch_r3_s_own_and_the_floors():
    assert set(bench.FLOORS) <= set(bench.STRATEGIES)
    for name in bench.STRATEGIES:
        strategy = strategies.get_strategy(name)
        assert strategy.description and (strategy.floor == (name in bench.FLOORS))
        assert name in bench.FLOORS or name.startswith(("torch_r3", "single-write"))


def test_without_its_reference_strategy_a_shape_has_no_speed_up_and_its_table_no_column():
    shape = bench.run_shape(bench.BenchConfig(**TINY), [bench.FRESH, bench.PACKED])
    assert shape.speedup_over is None and all(s.speedup is None for s in shape.strategies)
    head = bench.format_table(shape).splitlines()[0]
    assert "vs memcpy" in head and "vs single-write serial" not in head and "vs baseline" not in head
    over_fresh = bench.run_shape(bench.BenchConfig(**TINY), [bench.FRESH, bench.PACKED], speedup_over=bench.FRESH)
    assert over_fresh.get(bench.FRESH).speedup == 1.0
    assert "vs torch_r3 fresh" in bench.format_table(over_fresh).splitlines()[0]


def _two_threads(ctx):
    """torch_r3 fresh on two threads.

    More lines, not in the report.
    """
    return bench.run_strategy(bench.FRESH, ctx.batch, workers=2)


def _one_byte_off(ctx):
    out = _two_threads(ctx)
    out["rollout_expert_indices"].view(-1)[-1] += 1
    return out


def test_a_registered_strategy_runs_by_name_and_is_checked_like_torch_r3_s_own(monkeypatch):
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))  # the registry as it was, after
    mine = bench.register(bench.Strategy("two threads", _two_threads, "padded", description="mine"))
    assert bench.registered()["two threads"] is mine and "two threads" not in bench.STRATEGIES
    assert bench.Strategy("y", _two_threads, "padded").description == "torch_r3 fresh on two threads"
    assert bench.Strategy("z", _one_byte_off, "padded").description == ""  # no docstring, no description
    shape = bench.run_shape(bench.BenchConfig(**TINY), [bench.SERIAL, "two threads"])
    assert shape.get("two threads").checked_against == bench.SERIAL
    assert "  two threads          mine" in bench.format_report(dataclasses.replace(synthetic_result(), main=shape))
    bench.register(bench.Strategy("one byte off", _one_byte_off, "padded"))
    with pytest.raises(AssertionError, match="'one byte off'.*not bit-identical to 'single-write serial'"):
        bench.run_shape(bench.BenchConfig(**TINY), [bench.SERIAL, "one byte off"])
    bench.unregister("one byte off")
    assert "one byte off" not in bench.registered()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: bench.register(bench.Strategy(bench.FRESH, _two_threads, "padded")), ValueError, "registered already"),
        (lambda: bench.register(object()), TypeError, "takes a torch_r3.bench.strategies.Strategy, got object"),
        (lambda: bench.Strategy("x", _two_threads, "ragged"), ValueError, "layout must be one of"),
        (lambda: bench.Strategy("a,b", _two_threads, "padded"), ValueError, "without commas"),
        (lambda: bench.Strategy("x", None, "padded"), TypeError, "call must be callable"),
        (lambda: bench.Strategy("x", _two_threads, "padded", loop_calls=0), ValueError, "loop_calls must be >= 1"),
        (lambda: bench.unregister(bench.SERIAL), ValueError, "one of torch_r3's own strategies"),
        (lambda: bench.unregister("never registered"), ValueError, "registered strategy must be one of"),
        (lambda: bench.run_shape(bench.BenchConfig(**TINY), ["nope"]), ValueError, "non-empty selection"),
        (lambda: bench.plan(bench.BenchConfig(**TINY), speedup_over="nope"), ValueError, "speedup_over must be"),
    ],
    ids=["duplicate", "not-a-strategy", "layout", "comma", "call", "loop-calls", "own", "unknown", "run", "over"],
)
def test_a_bad_registration_or_name_is_refused_naming_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_strategy_that_differs_from_the_first_is_refused():
    batch = bench.make_batch(bench.BenchConfig(**TINY))
    reference = Reference(batch.token_counts)
    reference.check(strategies.get_strategy(bench.SERIAL), bench.run_strategy(bench.SERIAL, batch))
    out = bench.run_strategy(bench.FRESH, batch)
    out["rollout_expert_indices"].view(-1)[0] += 1
    with pytest.raises(AssertionError, match="torch_r3 fresh.*rollout_expert_indices is not bit-identical"):
        reference.check(strategies.get_strategy(bench.FRESH), out)


def test_a_packed_strategy_run_first_is_checked_once_a_padded_one_runs():
    batch = bench.make_batch(bench.BenchConfig(**TINY))
    reference = Reference(batch.token_counts)
    reference.check(strategies.get_strategy(bench.PACKED), bench.run_strategy(bench.PACKED, batch))
    assert reference.checked_against == {bench.PACKED: None}
    reference.check(strategies.get_strategy(bench.FRESH), bench.run_strategy(bench.FRESH, batch))
    assert reference.checked_against == {bench.PACKED: bench.FRESH, bench.FRESH: None}


def test_memory_check_refuses_a_run_that_does_not_fit():
    config = bench.BenchConfig(**bench.PRESETS["production"])
    need = bench.estimate_memory(config)
    assert need > 100 * 2**30

    def short() -> dict:
        return {"available": 8 * 2**30, "mem_available": 8 * 2**30, "cgroup_room": None, "cgroup": None}

    with pytest.raises(bench.InsufficientMemoryError, match=r"needs about .* GiB"):
        bench.check_memory(need, config.label, short)

    def plenty() -> dict:
        return {"available": need + 1, "mem_available": need + 1, "cgroup_room": None, "cgroup": None}

    bench.check_memory(need, config.label, plenty)


def test_available_memory_reports_meminfo():
    mem = bench.available_memory()
    assert mem["mem_available"] is None or mem["mem_available"] > 0
    assert mem["available"] is None or mem["available"] <= (mem["mem_available"] or mem["available"])


def test_peak_memory_is_per_call_not_process_lifetime():
    big = np.ones(200 << 20, np.uint8)  # an earlier, larger peak
    del big
    with memory.PeakRss() as peak:
        small = np.ones(32 << 20, np.uint8)
    del small
    assert 30 << 20 <= peak.extra < 150 << 20


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(distribution="zipf"), "distribution must be one of"),
        (dict(topk=200), "topk=200 needs at least"),
        (dict(num_experts=300, dtype="uint8"), "need int16"),
        (dict(mixed_dtypes=True, dtype="uint8"), "mixed_dtypes"),
        (dict(num_sequences=0), "num_sequences must be >= 1"),
        (dict(warmup=0), "warmup"),
    ],
)
def test_bad_configs_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.BenchConfig(**kwargs)


def test_dtype_follows_the_expert_count():
    assert bench.BenchConfig().dtype == "uint8" and bench.BenchConfig().num_experts == 128
    assert bench.BenchConfig(num_experts=256).dtype == "uint8"
    assert bench.BenchConfig(num_experts=257).dtype == "int16"
    assert dataclasses.replace(bench.BenchConfig(), dtype="int16").num_experts == 128


def test_the_plan_adds_a_typical_rl_pair_unless_the_main_shape_is_one():
    config = bench.BenchConfig(**TINY)
    assert bench.plan(config).pair.distribution == "typical_rl"
    assert bench.plan(config, packed_vs_padded=False).pair is None
    typical = bench.plan(dataclasses.replace(config, distribution="typical_rl"))
    assert typical.pair is None and typical.pair_is_main
    assert [c.num_sequences for c in bench.plan(config, sweep=[2, 6]).shapes] == [6, 6, 2]


def test_the_memory_needed_is_the_largest_shape_s():
    config = bench.BenchConfig(**TINY)
    run_plan = bench.plan(config, sweep=[3, 60])
    assert bench.memory_needed(run_plan) == bench.estimate_memory(dataclasses.replace(config, num_sequences=60))


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


def test_bench_json_holds_every_strategy_the_topology_and_the_versions(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert cli.main(["bench", *TINY_ARGS, "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "torch_r3 fresh" in out and f"wrote {path}" in err and f"wrote {path}" not in out
    data = json.loads(path.read_text())
    assert data["schema_version"] == 4
    assert [s["name"] for s in data["main"]["strategies"]] == list(bench.STRATEGIES)
    assert data["main"]["speedup_over"] == bench.SERIAL and data["packed_vs_padded"]["speedup_over"] is None
    for key in (
        "median_s",
        "min_s",
        "max_s",
        "times_s",
        "gb_per_s",
        "speedup",
        "ratio_to_memcpy",
        "peak_bytes",
        "peak_ratio",
        "checked_against",
    ):
        assert key in data["main"]["strategies"][0]
    assert data["main"]["config"]["num_sequences"] == 4
    assert {"usable_cpus", "pool_workers", "cgroup_cpu_limit", "OMP_NUM_THREADS"} <= set(data["topology"])
    assert [s["name"] for s in data["packed_vs_padded"]["strategies"]] == ["torch_r3 fresh", "torch_r3 packed"]
    assert data["packed_vs_padded"]["config"]["distribution"] == "typical_rl"
    import torch_r3

    assert data["versions"]["torch_r3"] == torch_r3.__version__ and data["versions"]["torch"] == torch.__version__
    from datetime import datetime

    assert datetime.fromisoformat(data["timestamp"]).tzinfo is not None
    assert "targets" not in data  # the project's yardstick, only with --check-targets


def test_a_tiny_shape_is_reported_in_small_units_and_called_too_small_to_time(capsys):
    assert cli.main(["bench", *TINY_ARGS, "--no-packed-compare"]) == 0
    out = capsys.readouterr().out
    assert "too small to time" in out
    assert " 0 MB" not in out and "0.00 GB/s" not in out and "0.0 ms" not in out


def test_bench_plot_writes_a_png_of_the_sweep(tmp_path):
    png = tmp_path / "chart.png"
    args = [
        "bench",
        *TINY_ARGS,
        "--plot",
        str(png),
        "--sweep",
        "2,4",
        "--strategies",
        "single-write serial,torch_r3 fresh",
        "--no-packed-compare",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert cli.main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads((tmp_path / "r.json").read_text())["sweep"]
    assert [p["config"]["num_sequences"] for p in sweep] == [2, 4]


def test_production_preset_is_refused_with_one_memory_figure(monkeypatch, capsys):
    monkeypatch.setattr(
        memory,
        "available_memory",
        lambda: {"available": 16 * 2**30, "mem_available": 16 * 2**30, "cgroup_room": None, "cgroup": None},
    )
    assert cli.main(["bench", "--preset", "production", "--no-progress"]) == cli.EXIT_MEMORY
    out, err = capsys.readouterr()
    assert out == ""
    assert "1024 seqs x max 32768 tokens" in err and "topk 22" in err and "int16" in err
    assert "refused" in err and "only 16.0 GiB is available" in err
    need = bench.memory_needed(bench.plan(bench.BenchConfig(**bench.PRESETS["production"])))
    assert err.count("GiB of memory") == 1 and f"needs about {need / 2**30:.1f} GiB" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-sequences", "0"], "expected a positive integer"),
        (["--distribution", "zipf"], "invalid choice"),
        (["--strategies", "single-write serial,fast"], "unknown ['fast']"),
        (["--speedup-over", "fastest"], "--speedup-over: unknown 'fastest'"),
        (["--num-experts", "300", "--dtype", "uint8"], "need int16"),
        (["--sweep", "4"], "--sweep only applies with --plot"),
    ],
)
def test_bad_bench_options_exit_2_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_benchmarks_script_uses_the_same_engine():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "collate_bench.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--preset" in done.stdout and "--mixed-dtypes" in done.stdout


# --------------------------------------------------------------------------
# torch_r3 steady and the DataLoader table
# --------------------------------------------------------------------------


def test_the_steady_loop_keeps_the_previous_batch_intact_and_matches_the_reference():
    batch = bench.make_batch(bench.BenchConfig(**TINY))
    want = reference_padded(batch.routes, batch.token_counts)
    steady = strategies.get_strategy(bench.STEADY)
    ctx = strategies.Context(batch, 2, [bench.STEADY])
    try:
        outputs = [steady.call(ctx) for _ in range(5)]  # every batch kept alive, as a list of batches would
        for out in outputs:
            assert_batch_equal(out, want)
        assert len({out["rollout_expert_indices"].data_ptr() for out in outputs}) == 5
    finally:
        ctx.close()


def test_the_dataloader_table_times_every_configuration_and_skips_pinning_without_an_accelerator():
    from torch_r3.collate._memory import accelerator_available

    config = bench.BenchConfig(num_sequences=6, max_seqlen=40, num_layers=2, topk=2)
    result = bench.run_dataloader(config, batch_size=4, epochs=1)
    assert result.num_batches == 2 and result.epochs == 1 and result.floor_batch_s > 0
    assert result.gather_floor_batch_s > 0 and result.gather_floor_epoch_s > 0
    assert [(r.num_workers, r.pin_memory, r.collator) for r in result.rows] == [
        (w, p, c) for w in (0, 2) for p in (False, True) for c in ("fresh", "recycled")
    ]
    for r in result.rows:
        if r.pin_memory and not accelerator_available():
            assert r.skipped and r.batch_s is None
            continue
        assert r.skipped is None and len(r.batch_times_s) == 2 and len(r.epoch_times_s) == 1
        assert r.batch_min_s <= r.batch_s <= r.batch_max_s
        assert r.ratio_to_floor == pytest.approx(r.batch_s / result.floor_batch_s)
        assert r.ratio_to_gather_floor == pytest.approx(r.batch_s / result.gather_floor_batch_s)
    table = report.format_dataloader_table(result)
    assert "vs memcpy floor" in table and "vs gather floor" in table
    assert "memcpy floor (cache-warm contiguous copy)" in table and "gather floor (each batch's own sources)" in table


def _byte_ranges(views, base):
    """Each view's `[start, end)` in bytes from `base`, sorted."""
    return sorted(
        (v.__array_interface__["data"][0] - base, v.__array_interface__["data"][0] - base + v.nbytes)
        for v in views.values()
    )


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("mixed", [False, True], ids=["uint8", "mixed-uint8-int16"])
def test_the_gather_floor_writes_exactly_each_batch_s_padded_layout_from_the_dataset_s_own_arrays(workers, mixed):
    from torch_r3.bench.dataloader import GatherFloor, RouteSamples

    # 20 trajectories: one in 16 carries an EOS (rows = tokens - 2), and the last batch is short.
    batch = bench.make_batch(
        bench.BenchConfig(num_sequences=20, max_seqlen=40, num_layers=3, topk=2, mixed_dtypes=mixed, seed=5)
    )
    dataset = RouteSamples(batch)
    with GatherFloor(dataset, 8, batch.dtype, workers) as floor:
        counts = batch.token_counts
        row = batch.num_layers * batch.topk * batch.dtype.itemsize + 1 + 8 + 8  # routes, two masks, int64 ids
        want_sizes = [len(counts[lo : lo + 8]) * max(counts[lo : lo + 8]) * row for lo in (0, 8, 16)]
        assert floor.sizes == want_sizes and len(floor.sizes) == 3
        for k in (2, 0, 1):  # any order: each copy writes every byte of its batch
            floor.buffer[:] = 0xA5  # garbage where nothing should survive
            got = floor.copy(k)
            samples = [dataset[i] for i in range(8 * k, min(8 * k + 8, 20))]
            want = reference_r3_collator(samples)
            assert_batch_equal({key: torch.from_numpy(v) for key, v in got.items()}, want)
            # The four outputs tile exactly the batch's output bytes at the front of the buffer, and
            # nothing past them is written.
            ranges = _byte_ranges(got, floor.buffer.ctypes.data)
            assert ranges[0][0] == 0 and ranges[-1][1] == floor.sizes[k]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert (floor.buffer[floor.sizes[k] :] == 0xA5).all()
    assert floor.pool is None  # the threads are shut down on leaving


def test_the_gather_floor_reads_the_sources_where_the_dataset_keeps_them():
    from torch_r3.bench.dataloader import GatherFloor, RouteSamples

    batch = bench.make_batch(bench.BenchConfig(**TINY))
    dataset = RouteSamples(batch)
    with GatherFloor(dataset, 3, batch.dtype, 2) as floor:
        assert floor.routes is batch.routes and floor.tokens is dataset.tokens  # no private copy to read from
        batch.routes[4][0, 0, 0] = 99  # a change to the dataset's array shows in the next copy
        out = floor.copy(1)
        assert out["rollout_expert_indices"][1, floor.T[1] - batch.token_counts[4], 0, 0] == 99


@pytest.mark.parametrize("batch_size", [0, 7])
def test_a_dataloader_batch_size_outside_the_dataset_is_refused(batch_size):
    with pytest.raises(ValueError, match="batch_size must be an int in \\[1, num_sequences=6\\]"):
        bench.run_dataloader(bench.BenchConfig(**TINY), batch_size=batch_size)


def test_a_bool_batch_size_is_a_type_error_and_a_numpy_int_is_accepted():
    # True was a ValueError; the one rule of torch_r3._checks makes a bool for an int a TypeError.
    with pytest.raises(TypeError, match="batch_size must be an int, got bool"):
        bench.run_dataloader(bench.BenchConfig(**TINY), batch_size=True)
    with pytest.raises(ValueError, match="num_sequences=6"):
        bench.run_dataloader(bench.BenchConfig(**TINY), batch_size=np.int64(7))


def test_the_dataloader_samples_share_the_batch_routes():
    from torch_r3.bench.dataloader import RouteSamples

    batch = bench.make_batch(bench.BenchConfig(**TINY))
    samples = RouteSamples(batch)
    assert len(samples) == 6
    for i, n in enumerate(batch.token_counts):
        assert samples[i]["routes"] is batch.routes[i]
        assert samples[i]["input_ids"].shape == (n,) and samples[i]["input_ids"].dtype == np.int64


# --------------------------------------------------------------------------
# --check-targets, on synthetic results
# --------------------------------------------------------------------------


def synthetic_result(
    *,
    steady_s=0.030,
    memcpy_s=0.027,
    baseline_s=0.495,
    loader_ratio=1.2,
    steady_peak=None,
    with_dataloader=True,
    gather_floor_s=0.008,
    fresh_s=0.040,
    gather_s=0.031,
    packed_steady_s=0.012,
    packed_gather_s=0.010,
    rounds=None,
    busy=(),
):
    """A BenchResult of the default shape with chosen medians (input 350 MB, padded output 688 MB).

    `rounds` gives some strategies' per-round times ({name: [s, ...]}); the others have one round.
    """

    def strategy(name, median, peak=1_000_000_000):
        times = (rounds or {}).get(name, [median])
        return bench.StrategyResult(
            name=name,
            times_s=times,
            median_s=median,
            min_s=min(times),
            max_s=max(times),
            bytes_written=688_000_000,
            gb_per_s=688e6 / median,
            peak_extra_bytes=0,
            peak_bytes=peak,
            peak_ratio=None,
        )

    inp, out = 350_000_000, 688_000_000
    main = bench.ShapeResult(
        config=dataclasses.asdict(bench.BenchConfig()),
        label="default",
        T=8170,
        tokens=1,
        input_bytes=inp,
        padded_bytes=out,
        packed_bytes=out,
        workers=2,
        peak_method="test",
        strategies=[
            strategy(BASELINE, baseline_s),
            strategy(bench.FRESH, fresh_s),
            strategy(bench.STEADY, steady_s, steady_peak or inp + 2 * out),
            strategy(bench.PACKED_STEADY, packed_steady_s),
            strategy(bench.GATHER, gather_s),
            strategy(bench.PACKED_GATHER, packed_gather_s),
            strategy(bench.MEMCPY, memcpy_s),
        ],
    )
    loader = None
    if with_dataloader:
        batch_s = 0.01 * loader_ratio
        row = bench.DataLoaderRow(
            num_workers=0,
            pin_memory=False,
            collator="recycled",
            batch_times_s=[batch_s],
            batch_s=batch_s,
            batch_min_s=batch_s,
            batch_max_s=batch_s,
            epoch_times_s=[8 * batch_s],
            epoch_s=8 * batch_s,
            ratio_to_floor=loader_ratio,
            ratio_to_gather_floor=batch_s / gather_floor_s if gather_floor_s else None,
        )
        loader = bench.DataLoaderResult(
            batch_size=32,
            num_batches=8,
            batch_bytes=1,
            floor_batch_s=0.01,
            floor_epoch_s=0.08,
            epochs=3,
            rows=[row],
            gather_floor_batch_s=gather_floor_s,
            gather_floor_epoch_s=8 * gather_floor_s if gather_floor_s else None,
        )
    return bench.BenchResult(
        main=main,
        packed_vs_padded=None,
        sweep=[],
        dataloader=loader,
        topology=cpu_topology(),
        memory_needed_bytes=0,
        wall_s=1.0,
        peak_rss_bytes=None,
        busy=list(busy),
    )


@pytest.mark.parametrize(
    "changes, missed",
    [
        (dict(), []),
        (dict(steady_s=0.034), ["steady_vs_memcpy"]),  # 1.26x the floor
        (dict(steady_s=0.0336, memcpy_s=0.0300), []),  # 1.12x the floor, 14.7x baseline
        (dict(baseline_s=0.200), ["steady_vs_baseline"]),  # 6.7x
        (dict(loader_ratio=1.51), ["dataloader_vs_floor"]),
        (dict(steady_peak=350_000_000 + 2 * 688_000_000 + (1 << 20)), []),  # 1 MiB of bookkeeping allowed
        (dict(steady_peak=350_000_000 + 2 * 688_000_000 + (1 << 20) + 1), ["steady_peak_memory"]),
        (dict(with_dataloader=False), ["dataloader_vs_floor"]),
        (dict(fresh_s=0.0541), ["fresh_vs_memcpy"]),  # 2.004x the memcpy limit
        (dict(gather_s=0.0272), ["steady_vs_gather"]),  # steady 1.103x the gather floor
        (dict(packed_steady_s=0.01251), ["packed_steady_vs_packed_gather"]),  # 1.251x
    ],
    ids=[
        "all-met",
        "steady-slow",
        "steady-near-floor",
        "baseline-fast",
        "loader-slow",
        "peak-at-bound",
        "peak-high",
        "no-loader",
        "fresh-slow",
        "steady-above-gather",
        "packed-steady-slow",
    ],
)
def test_each_target_is_judged_against_its_threshold(changes, missed):
    checked = targets.check_targets(synthetic_result(**changes))
    assert [t["name"] for t in checked] == [t.name for t in targets.TARGETS]
    assert [t["name"] for t in checked if not t["met"]] == missed
    assert targets.targets_met(checked) == (not missed)
    want_steady = synthetic_result(**changes).main
    steady_vs_memcpy = want_steady.get(bench.STEADY).median_s / want_steady.get(bench.MEMCPY).median_s
    assert checked[0]["value"] == pytest.approx(steady_vs_memcpy)


@pytest.mark.parametrize("gather_floor_s", [0.008, 0.0151, None], ids=["below", "at-the-batch", "not-measured"])
def test_the_gather_floor_is_printed_beside_the_dataloader_target_and_never_judged(gather_floor_s):
    # The batch takes 1.51x the memcpy floor: missed, whatever the gather floor says.
    result = synthetic_result(loader_ratio=1.51, gather_floor_s=gather_floor_s)
    checked = targets.check_targets(result)
    loader = next(t for t in checked if t["name"] == "dataloader_vs_floor")
    assert loader["value"] == pytest.approx(1.51) and loader["threshold"] == 1.5 and not loader["met"]
    assert not targets.targets_met(checked)
    assert all("beside" not in t for t in checked if t["name"] != "dataloader_vs_floor")
    beside = loader["beside"]
    assert beside["batch_s"] == pytest.approx(0.0151) and beside["memcpy_floor_s"] == 0.01
    assert beside["gather_floor_s"] == gather_floor_s
    text = targets.format_targets(checked)
    assert "[MISSED] DataLoader num_workers=0" in text
    if gather_floor_s is None:
        assert beside["vs_gather_floor"] is None and "against the gather floor" not in text
    else:
        assert beside["vs_gather_floor"] == pytest.approx(0.0151 / gather_floor_s)
        assert f"{0.0151 / gather_floor_s:.2f} against the gather floor" in text
        gap = f"{(gather_floor_s - 0.01) * 1e3:+.1f} ms copying the batch's own sources from where they live"
        assert gap in text and f"{(0.0151 - gather_floor_s) * 1e3:+.1f} ms the collator and DataLoader" in text


@pytest.mark.parametrize("changes, code", [(dict(), 0), (dict(steady_s=0.05), 1)])
def test_check_targets_exits_1_when_a_target_is_missed_and_prints_them_only_then(
    monkeypatch, capsys, tmp_path, changes, code
):
    calls = []

    def fake_run(run_plan, **kwargs):
        calls.append((run_plan, kwargs))
        return synthetic_result(**changes)

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(memory, "available_memory", lambda: {"available": None})
    path = tmp_path / "r.json"
    assert cli.main(["bench", "--check-targets", "--no-progress", "--json", str(path)]) == code
    out = capsys.readouterr().out
    assert "targets (default shape" in out and ("MISSED" in out) == bool(code)
    assert calls[0][1]["dataloader_batch_size"] == bench.DEFAULT_BATCH_SIZE  # the DataLoader table is needed
    assert "against the gather floor" in out
    data = json.loads(path.read_text())
    judged = data["targets"]
    assert [t["met"] for t in judged] == [t["met"] for t in targets.check_targets(synthetic_result(**changes))]
    assert judged[2]["beside"]["vs_gather_floor"] == pytest.approx(1.5)
    assert data["dataloader"]["gather_floor_batch_s"] == 0.008
    assert data["dataloader"]["rows"][0]["ratio_to_gather_floor"] == pytest.approx(1.5)


def test_the_dataloader_json_carries_both_floors_and_both_ratios_per_row(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert cli.main(["bench", *TINY_ARGS, "--dataloader", "--batch-size", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memcpy floor (cache-warm contiguous copy)" in out and "gather floor (each batch's own sources)" in out
    loader = json.loads(path.read_text())["dataloader"]
    for key in ("floor_batch_s", "floor_epoch_s", "gather_floor_batch_s", "gather_floor_epoch_s"):
        assert loader[key] > 0, key
    for row in loader["rows"]:
        assert {"ratio_to_floor", "ratio_to_gather_floor"} <= set(row)
        if row["skipped"] is None:
            assert row["ratio_to_floor"] == pytest.approx(row["batch_s"] / loader["floor_batch_s"])
            assert row["ratio_to_gather_floor"] == pytest.approx(row["batch_s"] / loader["gather_floor_batch_s"])


def test_check_targets_refuses_a_shape_other_than_the_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--check-targets", *TINY_ARGS])
    assert e.value.code == 2
    assert "--check-targets judges the default shape only" in capsys.readouterr().err


def test_the_gpu_check_skips_cleanly_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout


@pytest.mark.parametrize("name", ["__init__", "config", "memory", "runner", "units"])
def test_the_bench_docstring_examples_hold(name):
    import doctest
    import importlib

    module = importlib.import_module("torch_r3.bench" if name == "__init__" else f"torch_r3.bench.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_the_packed_strategy_s_peak_memory_leaves_out_the_check_s_copies():
    # Big enough that the packed reference (cut from the padded one) would show in the peak.
    config = bench.BenchConfig(num_sequences=8, max_seqlen=4096, num_layers=40, topk=8, repeats=1)
    shape = bench.run_shape(config, [bench.FRESH, bench.PACKED])
    packed = shape.get(bench.PACKED)
    assert packed.checked_against == bench.FRESH
    assert packed.peak_extra_bytes < shape.packed_bytes + (shape.packed_bytes >> 1)


# --------------------------------------------------------------------------
# Options that cannot work fail before any set-up, in one line
# --------------------------------------------------------------------------


def _one_line_usage_error(argv, needle, capsys, monkeypatch):
    """`argv` exits 2 with one line on stderr naming `needle`, before the run is set up."""
    monkeypatch.setattr(bench, "run", _never_run)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def _never_run(*args, **kwargs):
    raise AssertionError("the run was set up although an option could never work")


def test_bench_refuses_more_workers_than_the_cap_up_front(capsys, monkeypatch):
    _one_line_usage_error(["bench", "--workers", "100", *TINY_ARGS], "64", capsys, monkeypatch)


def test_bench_json_into_a_missing_directory_fails_up_front(tmp_path, capsys, monkeypatch):
    path = tmp_path / "missing" / "out.json"
    _one_line_usage_error(["bench", *TINY_ARGS, "--json", str(path)], str(path.parent), capsys, monkeypatch)


@pytest.mark.parametrize("where", ["missing", "directory"])
def test_bench_plot_to_a_path_it_cannot_write_fails_up_front(tmp_path, capsys, monkeypatch, where):
    pytest.importorskip("matplotlib")
    path = tmp_path / "missing" / "chart.png" if where == "missing" else tmp_path
    _one_line_usage_error(["bench", *TINY_ARGS, "--plot", str(path)], "--plot", capsys, monkeypatch)


def test_bench_survives_a_load_average_the_os_will_not_give(monkeypatch, capsys):
    def refuse():
        raise OSError("Load averages are unobtainable")

    monkeypatch.setattr(os, "getloadavg", refuse)
    assert cli.main(["bench", *TINY_ARGS, "--strategies", "single-write serial,torch_r3 fresh"]) == 0
    assert "load average unknown" in capsys.readouterr().out


def test_the_targets_ship_in_the_checkout_not_in_the_package():
    import torch_r3

    package = Path(torch_r3.__file__).parent
    assert not (package / "bench" / "targets.py").exists()
    assert (ROOT / "benchmarks" / "targets.py").is_file() and targets.TARGETS


def test_check_targets_outside_a_checkout_says_it_needs_one(monkeypatch, tmp_path, capsys):
    from torch_r3.bench import checkout

    monkeypatch.delitem(sys.modules, checkout.TARGETS_MODULE)
    monkeypatch.setattr(checkout, "targets_path", lambda: tmp_path / "benchmarks" / "targets.py")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--check-targets", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--check-targets needs a torch_r3 checkout" in err and err.count("\n") == 1


# --------------------------------------------------------------------------
# A busy machine: warned about in the report, never judged
# --------------------------------------------------------------------------


def test_the_report_warns_when_the_load_average_says_the_machine_is_busy(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (27.8, 20.0, 10.0))
    assert cli.main(["bench", *TINY_ARGS, "--strategies", "single-write serial,torch_r3 fresh"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: the machine was busy: the load average was 27.80 when the run started" in out


def test_a_quiet_load_average_gives_no_load_warning(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.05, 0.05, 0.05))
    assert cli.main(["bench", *TINY_ARGS, "--strategies", "single-write serial,torch_r3 fresh"]) == 0
    assert "the load average was" not in capsys.readouterr().out


def test_a_floor_whose_rounds_spread_widely_marks_the_run_busy():
    from torch_r3.bench.trust import SPREAD_LIMIT, busy_reasons

    calm = synthetic_result(rounds={bench.MEMCPY: [0.027, 0.028, 0.027]})
    calm.topology = {**calm.topology, "loadavg_1min": 0.1}
    assert busy_reasons(calm) == []
    noisy = synthetic_result(rounds={bench.MEMCPY: [0.027, 0.027 * SPREAD_LIMIT * 1.01, 0.028]})
    noisy.topology = {**noisy.topology, "loadavg_1min": None}  # unknown load: the spread alone decides
    (reason,) = busy_reasons(noisy)
    assert "memcpy limit's rounds ranged from 27.0" in reason


def test_check_targets_refuses_to_judge_a_busy_run(monkeypatch, capsys):
    busy = ["the load average was 27.80 when the run started, on 2 usable CPUs: other work already wanted every CPU"]
    monkeypatch.setattr(bench, "run", lambda run_plan, **kwargs: synthetic_result(busy=busy))
    monkeypatch.setattr(memory, "available_memory", lambda: {"available": None})
    assert cli.main(["bench", "--check-targets", "--no-progress"]) == 1  # all would be met on a quiet machine
    captured = capsys.readouterr()
    assert "targets NOT JUDGED: the machine was busy" in captured.out and "[met]" not in captured.out
    assert "targets not judged" in captured.err
    checked = targets.check_targets(synthetic_result(busy=busy))
    assert all(t["met"] is None for t in checked) and not targets.targets_met(checked)


def test_check_targets_prints_the_ratio_of_every_round():
    steady, memcpy = [0.030, 0.033, 0.029], [0.027, 0.026, 0.028]
    checked = targets.check_targets(synthetic_result(rounds={bench.STEADY: steady, bench.MEMCPY: memcpy}))
    target = next(t for t in checked if t["name"] == "steady_vs_memcpy")
    assert target["rounds"] == pytest.approx([a / b for a, b in zip(steady, memcpy)])
    text = targets.format_targets(checked)
    assert "per round: " + ", ".join(f"{a / b:.2f}" for a, b in zip(steady, memcpy)) in text
    assert "rounds" not in next(t for t in checked if t["name"] == "steady_peak_memory")


@pytest.mark.parametrize("mode", ["madvise", "never", None])
def test_the_report_says_which_pages_outputs_and_floors_were_on(mode):
    result = synthetic_result()
    result.thp_mode = mode
    text = bench.format_report(result)
    line = next(line for line in text.splitlines() if line.startswith("transparent hugepages:"))
    if mode == "never":
        assert "off" in line and "small-page floor" in line
    elif mode == "madvise":
        assert "hugepage-advised alike" in line
    else:
        assert "unknown" in line
