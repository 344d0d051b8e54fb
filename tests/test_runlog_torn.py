"""A run log that a crash cut mid-write (issue 43 item 11): the writer resumes on a fresh
line, and the reader skips the torn line with a warning that names it, losing nothing else."""

from __future__ import annotations

import json
import math

import pytest

from torch_r3.cli import main
from torch_r3.runlog import RunLog, read_run_log


def _write(path, steps, **meta):
    with RunLog(path, rank=0) as log:
        for step in steps:
            log.write(step, {"loss": 1.0 / (step + 1), "route_drift/mean": math.nan}, run="r3", lr=1e-4, **meta)


def _cut(path, keep):
    """Crash mid-write: the file's last line loses all but its first `keep` bytes (and its newline)."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: start + keep])
    return data[start:]


def test_a_resumed_log_starts_a_fresh_line_after_a_torn_one_and_keeps_every_whole_step(tmp_path):
    path = tmp_path / "run.jsonl"
    _write(path, [0, 1, 2])
    torn = _cut(path, 25)  # step 2's line, cut short
    _write(path, [2, 3])  # the resumed run writes step 2 again, then 3
    lines = path.read_bytes().split(b"\n")
    assert lines[2] == torn[:25] and lines[-1] == b""  # the torn bytes stand alone on their line
    assert [json.loads(line)["step"] for line in lines[3:-1]] == [2, 3]  # the new records are whole
    with pytest.warns(UserWarning, match=r"run.jsonl:3: a torn line \(a write cut short\) is skipped") as seen:
        records = read_run_log(path)
    assert len(seen) == 1
    assert [r.step for r in records] == [0, 1, 2, 3]
    assert [r.metrics["loss"] for r in records] == [1.0, 0.5, 1 / 3, 0.25]
    # and the report draws the page from it
    with pytest.warns(UserWarning, match=r"run.jsonl:3: a torn line"):
        assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    assert "<td>r3</td><td>3</td><td>loss</td><td>0.25</td>" in (tmp_path / "r.html").read_text()


def test_a_log_that_ends_in_a_newline_is_resumed_without_an_empty_line(tmp_path):
    path = tmp_path / "run.jsonl"
    _write(path, [0])
    _write(path, [1])
    assert path.read_bytes().count(b"\n") == 2 and b"\n\n" not in path.read_bytes()


def test_every_cut_of_a_line_is_read_as_torn_whether_last_or_resumed_over(tmp_path):
    """The reference is the writer's own line: each of its proper prefixes is a torn write."""
    path = tmp_path / "run.jsonl"
    _write(path, [0, 1], note='a "quoted" {"step": 9} \u00e9')
    whole = path.read_bytes()
    line = _cut(path, 0)
    path.write_bytes(whole)
    for keep in range(1, len(line) - 1):  # up to the last byte before the newline: any cut
        path.write_bytes(whole[: len(whole) - len(line) + keep])
        with pytest.warns(UserWarning, match=r"run.jsonl:2: a torn line"):
            assert [r.step for r in read_run_log(path)] == [0], keep
        _write(path, [5])
        with pytest.warns(UserWarning, match=r"run.jsonl:2: a torn line"):
            assert [r.step for r in read_run_log(path)] == [0, 5], keep


def test_a_torn_line_that_an_older_writer_appended_a_record_to_gives_the_record_back(tmp_path):
    """0.2.0's writer appended onto the torn bytes: the whole record behind them is kept."""
    path = tmp_path / "run.jsonl"
    _write(path, [0, 1])
    line = _cut(path, 30)
    with path.open("ab") as f:
        f.write(line)  # the next record, on the torn line, as 0.2.0 wrote it
    with pytest.warns(UserWarning, match=r"run.jsonl:2: a torn line \(a write cut short\) is skipped"):
        records = read_run_log(path)
    assert [r.step for r in records] == [0, 1] and records[1].meta["lr"] == 1e-4


@pytest.mark.parametrize(
    "line",
    [
        '{"step": 0, "rank": 0, "metrics": {"a": 1}} trailing',  # whole, then more: not torn
        '{"step": 0, "rank": 0, "metrics": {"a": 1x',  # corrupt inside
        '{"step": 0, "rank": 0, "metrics": {"a": 1}, "meta": {}}}',
        '["step"',  # a prefix, but not of an object the writer writes
        "not json",
    ],
)
def test_a_line_that_is_no_torn_write_is_still_refused(tmp_path, line):
    path = tmp_path / "run.jsonl"
    _write(path, [0])
    with path.open("a") as f:
        f.write(line + "\n")
    _write(path, [1])
    with pytest.raises(ValueError, match=r"run.jsonl:2: not a JSON line|run.jsonl:2: expected a JSON object"):
        read_run_log(path)
