"""`benchmarks/wire.py` end to end on tiny bodies: every path gives today's routes, and the report has its parts.

No timing is asserted: the figures of a run this small mean nothing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _wire_bench():
    spec = importlib.util.spec_from_file_location("wire_bench", ROOT / "benchmarks" / "wire.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["wire_bench"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_path_of_the_wire_bench_decodes_the_routes_its_bodies_carry():
    bench = _wire_bench()
    cases = bench.make_cases([64], seed=3)
    assert {c.label.split()[0] for c in cases} == {"sglang", "vllm"} and len(cases) == 4
    for case in cases:
        for path in (bench.today, bench.new, bench.fallback):
            got = path(case)
            assert got.dtype == case.routes.dtype and np.array_equal(got, case.routes), (case.label, path.__name__)
        experts = bench.MODELS[case.label.split()[2]][1]
        assert case.routes.shape == (63, 61, 8) and case.routes.max() < experts
        assert case.routes.dtype == (np.uint8 if experts <= 256 else np.int16)


def test_the_small_bodies_of_the_wire_bench_are_read_as_they_were_built():
    bench = _wire_bench()
    cases = bench.small_cases(seed=3)
    assert [c.server for c in cases] == ["vllm-openai", "sglang"]
    for case in cases:
        got = bench.client_read(case)
        assert got.routed_experts.dtype == np.uint8 and np.array_equal(got.routed_experts, case.routes)
        assert len(got.response_ids) == bench.SMALL_TURN["generated"] and len(got.response_logprobs) == 32
        assert case.routes.shape == (95, 4, 4) and all(
            len(set(row)) == 4 for row in case.routes.reshape(-1, 4).tolist()
        )
    assert 5_000 < len(cases[0].body) < 7_000  # the size of engine_bench's bodies


def test_the_wire_bench_reports_paths_rounds_in_flight_and_memory(tmp_path, capsys):
    out = tmp_path / "wire.json"
    assert _wire_bench().main(["--tokens", "64", "--rounds", "2", "--in-flight", "1", "2", "--json", str(out)]) == 0
    report = capsys.readouterr().out
    for words in ("body -> compact routes", "round 2:", "2 in flight", "peak memory on top of the body", "pybase64") + (
        "small bodies",
        "client/json.loads",
        "vllm-openai 64+32 tokens",
        "sglang 64+32 tokens",
    ):
        assert words in report, words
    figures = json.loads(out.read_text())
    assert set(figures) == {"times_s", "small_s", "in_flight_s", "peak_bytes"}
    assert all(len(times) == 10 for case in figures["small_s"].values() for times in case.values())
    assert all(len(times) == 2 for case in figures["times_s"].values() for times in case.values())
