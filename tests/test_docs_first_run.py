"""What a newcomer reads first is what the package does (issue 45, items 2, 5 and 6).

The options Getting started teaches are the collator's current spellings; the README's
first run from the wheel names commands and options the CLI has; the package's face
(`dir(torch_r3)`) lists its API and nothing it imported for itself; the testing page
counts the protocols the loopback server has; the pages that a newcomer starts from name
the run log and its report. None of these starts a process.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shlex
import types
from pathlib import Path

import pytest
import tomllib

import torch_r3
from torch_r3 import Memory, Packed, Padded, PromptResponse, R3Collator, cli
from torch_r3.collate.layout import LAYOUT_KEYWORDS, MEMORY_KEYWORDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section, up to the next heading of its level."""
    start = re.search(rf"^{re.escape(heading)}$", text, re.M).end() + 1
    level = heading.split(" ", 1)[0]
    nxt = re.search(rf"^{level} ", text[start:], re.M)
    return text[start:] if nxt is None else text[start : start + nxt.start()]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S)


# ---------------------------------------------------------------------------
# 45.2: the options table teaches the spellings that do not warn
# ---------------------------------------------------------------------------

VALUE_TYPES = {cls.__name__: cls for cls in (Padded, Packed, PromptResponse, Memory)}


def _option_spellings(cell: str) -> list[tuple[str, str | None]]:
    """(collator keyword, value type or None) per backticked spelling of a table's first cell."""
    out = []
    for code in re.findall(r"`([^`]+)`", cell):
        m = re.fullmatch(r"(?P<kw>\w+)(?:=(?P<type>\w+)\((?P<fields>[^)]*)\))?", code)
        assert m is not None, f"an option spelled {code!r}: expected `keyword` or `keyword=Value(field=)`"
        out.append((m["kw"], None))
        if m["type"]:
            cls = VALUE_TYPES[m["type"]]
            names = {f.name for f in dataclasses.fields(cls)}
            for field in re.findall(r"(\w+)=", m["fields"]):
                assert field in names, f"{code}: {m['type']} has no field {field!r} (fields: {sorted(names)})"
    return out


def test_getting_started_options_are_collator_keywords_and_value_fields_not_deprecated_spellings():
    table = _section(GETTING_STARTED.read_text(), "## Options that matter")
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 5, "the options table is gone"
    params = inspect.signature(R3Collator).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    deprecated = set(LAYOUT_KEYWORDS) | set(MEMORY_KEYWORDS) | {"padding", "layers"}
    for cell in rows:
        for keyword, _ in _option_spellings(cell):
            assert keyword not in deprecated, (
                f"Getting started teaches R3Collator({keyword}=), a deprecated spelling: teach the "
                f"Padded(...)/Packed(...)/Memory(...) value it folds into"
            )
            assert keyword in keywords, f"Getting started names {keyword!r}, which R3Collator does not take"


def test_the_option_parser_refuses_a_field_the_value_does_not_have():
    assert _option_spellings("`memory=Memory(workers=)`") == [("memory", None)]
    with pytest.raises(AssertionError, match="Memory has no field 'pad_to_multiple_of'"):
        _option_spellings("`memory=Memory(pad_to_multiple_of=)`")


# ---------------------------------------------------------------------------
# 45.5: the package's face, the testing page's count, where the run log is named
# ---------------------------------------------------------------------------


def test_dir_of_the_package_lists_its_api_and_public_submodules_only():
    names = dir(torch_r3)
    assert set(torch_r3.__all__) <= set(names)
    others = [n for n in names if n not in torch_r3.__all__ and not (n.startswith("__") and n.endswith("__"))]
    for name in others:
        value = getattr(torch_r3, name)
        assert isinstance(value, types.ModuleType) and value.__name__ == f"torch_r3.{name}", (
            f"dir(torch_r3) shows {name!r} ({value!r}), which is neither in __all__ nor a public submodule"
        )
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "logging"} & set(names)
    assert not [n for n in names if n.startswith("_") and not n.endswith("__")], "a private name in dir(torch_r3)"


def test_the_lazy_names_and_the_renamed_ones_still_resolve():
    assert torch_r3.RemoteGenerateClient.__module__ == "torch_r3.rollout.client"
    with pytest.warns(DeprecationWarning, match="torch_r3.BatchLayout is deprecated"):
        assert torch_r3.BatchLayout is torch_r3.BatchGeometry


def test_the_testing_page_counts_and_documents_every_loopback_protocol():
    from torch_r3.testing._wire import PROTOCOLS

    page = (ROOT / "docs" / "api" / "testing.md").read_text()
    m = re.search(r"^## One server, (\w+) protocols$", page, re.M)
    assert m is not None and NUMBERS[m[1]] == len(PROTOCOLS), (
        f"the page says {m and m[1]}, the server has {len(PROTOCOLS)}"
    )
    sections = set(re.findall(r'^### `"([\w-]+)"`$', _section(page, "## What each protocol accepts and answers"), re.M))
    assert sections == set(PROTOCOLS), f"protocols without a section: {sorted(set(PROTOCOLS) - sections)}"


@pytest.mark.parametrize("page", [README, GETTING_STARTED], ids=lambda p: p.name)
def test_the_first_pages_name_the_run_log_and_its_report(page):
    text = page.read_text()
    assert "torch-r3 report" in text and "RunLog" in text, f"{page.name} names neither the report nor RunLog"


def test_the_bench_extra_says_that_the_report_needs_it():
    row = next(line for line in GETTING_STARTED.read_text().splitlines() if line.startswith("| `bench` |"))
    assert "torch-r3 report" in row, row


def test_the_verl_page_installs_torch_r3_from_its_wheel_not_a_checkout():
    (block,) = _bash_blocks(_section((ROOT / "docs" / "guides" / "verl.md").read_text(), "## Install"))
    torch_r3_line = next(line for line in block.splitlines() if "torch_r3" in line)
    assert "pip install -e" not in torch_r3_line and "torch_r3-" in torch_r3_line, torch_r3_line


def test_the_tutorial_says_the_demo_runs_from_the_wheel():
    intro = (ROOT / "docs" / "guides" / "tutorial-rl-step.md").read_text().split("\n## ", 1)[0]
    assert "from a checkout:" not in intro and "half a minute" not in intro
    assert "wheel" in intro.split("```", 1)[0]


# ---------------------------------------------------------------------------
# 45.6: the README's first run from the wheel
# ---------------------------------------------------------------------------


def _first_run_commands() -> list[list[str]]:
    (block,) = _bash_blocks(_section(README.read_text(), "## First run from the wheel"))
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_first_run_installs_extras_the_wheel_has():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    wheel = [arg for argv in _first_run_commands() for arg in argv if ".whl[" in arg]
    assert wheel, "the first run installs no wheel"
    for arg in wheel:
        named = set(arg.split("[", 1)[1].rstrip("]").split(","))
        assert named <= extras, f"{arg}: no such extra {sorted(named - extras)}"
        assert {"client", "megatron", "bench"} <= named, "the demo needs client and megatron, the report bench"


def test_the_first_run_commands_are_the_clis_with_options_it_takes():
    runs = [argv[1:] for argv in _first_run_commands() if argv[0] == "torch-r3"]
    assert [argv[0] for argv in runs] == ["doctor", "demo", "report"]
    for argv in runs:
        assert argv[0] in cli.COMMANDS
        parser, _ = cli._parser(argv[0])
        args = parser.parse_args(argv)  # an unknown option or a missing argument exits here
        assert args.command == argv[0]
    demo_log = next(argv[argv.index("--run-log") + 1] for argv in runs if argv[0] == "demo")
    assert ["report", demo_log] in runs, "the report reads the log the demo wrote"


def test_the_first_run_links_the_loopback_example_and_the_run_log_docs():
    section = _section(README.read_text(), "## First run from the wheel")
    links = re.findall(r"\]\(([^)#]+)", section)
    assert "docs/api/runlog.md" in links and "examples/server_rollout.py" in links, links
    assert all((ROOT / link).exists() for link in links), links
