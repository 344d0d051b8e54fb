"""What the pages tell a new user about the package itself is true.

The version the wheel reports is the CHANGELOG's newest section; the install lines name
every extra a guide needs; the Comparison page says of `torch_r3` what the README's
feature table says; a guide that points at a file only a checkout has says so.
None of these starts a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torch_r3

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
SECTION = re.compile(r"^## \[(?P<name>[^\]]+)\]", re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _changelog_sections() -> list[tuple[str, str]]:
    """(heading name, body) of each `## [...]` section, newest first."""
    text = CHANGELOG.read_text()
    heads = list(SECTION.finditer(text))
    links = text.find("\n[", heads[-1].end()) if heads else -1
    out = []
    for k, m in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else (links if links > 0 else len(text))
        out.append((m["name"], text[m.end() : end]))
    return out


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


# ---------------------------------------------------------------------------
# One version: the wheel's, the CHANGELOG's newest section, the install lines' (item 17)
# ---------------------------------------------------------------------------


def test_the_changelogs_newest_section_is_the_version_the_package_reports():
    """The changes a user reads as "this version" are the ones the wheel they installed has."""
    names = [name for name, _ in _changelog_sections()]
    assert names and names[0] == torch_r3.__version__, (
        f"the CHANGELOG's newest section is [{names[0] if names else None}] but torch_r3.__version__ is "
        f"{torch_r3.__version__}: the changes since the last release are this version's, so they go under its heading"
    )
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", n) for n in names), f"a section that is no version: {names}"
    tuples = [_as_tuple(n) for n in names]
    assert tuples == sorted(tuples, reverse=True) and len(set(tuples)) == len(tuples), names


# "from 0.1.0", "against v0.1.0": a version of ours, not a dependency's (torch 2.13.0, SkyRL 0.4.0)
COMPARES = re.compile(r"\b(?:from|against|since|than) v?(\d+\.\d+\.\d+)\b")


def _compared_versions(body: str) -> list[str]:
    return COMPARES.findall(" ".join(body.split()))


def test_every_version_a_changelog_section_compares_against_is_an_older_release():
    """'differ from 0.1.0' in a section means a release before that section's version."""
    sections = _changelog_sections()
    found = {}
    for k, (name, body) in enumerate(sections):
        older = {n for n, _ in sections[k + 1 :]}
        found[name] = _compared_versions(body)
        for named in found[name]:
            assert named in older, f"[{name}] compares against {named}, which is no older section of the CHANGELOG"
    # Not vacuous: the 0.3.0 section compares against 0.2.0 ("the changes since 0.2.0") and the
    # released 0.2.0 section against 0.1.0 ("bytes differ from 0.1.0"); a pattern that stops seeing
    # those sees nothing at all (the next test reads one wrapped over lines).
    assert found.get("0.3.0") == ["0.2.0"] and found.get("0.2.0") == ["0.1.0"], found


def test_the_comparison_pattern_reads_a_version_of_ours_and_skips_a_dependencys():
    text = "bytes differ from\n  0.1.0 for every row; faster than v0.2.0; tested against SkyRL 0.4.0 and torch 2.13.0"
    assert _compared_versions(text) == ["0.1.0", "0.2.0"]


def test_the_changelog_links_every_section_to_its_tag_or_comparison():
    text = CHANGELOG.read_text()
    for name, _ in _changelog_sections():
        assert re.search(rf"^\[{re.escape(name)}\]: https://\S+$", text, re.M), f"[{name}] has no link line"


def test_every_version_of_torch_r3_a_page_names_is_this_one():
    """A wheel name, a pinned index line or a doctor transcript on a page is the version `make dist` builds."""
    want = torch_r3.__version__
    patterns = (
        r"torch_r3-(\d+\.\d+\.\d+)-py3",  # a wheel name
        r"torch_r3\[[a-z,]+\]==(\d+\.\d+\.\d+)",  # a pinned install line
        r"torch_r3 +(\d+\.\d+\.\d+)\b",  # a doctor transcript
        r"(?:Once|once|until|Until) (\d+\.\d+\.\d+) is published",  # the install note
    )
    hits = {pattern: 0 for pattern in patterns}
    for page in _pages():
        text = page.read_text()
        for pattern in patterns:
            for named in re.findall(pattern, text):
                hits[pattern] += 1
                assert named == want, (
                    f"{page.relative_to(ROOT)} names torch_r3 {named} ({pattern}); the package is {want}"
                )
    # Not vacuous: README and getting-started show a wheel name, a pinned install line and the
    # install note, and the containers guide a doctor transcript. A pattern that sees none of
    # them no longer checks anything: fix the pattern, or drop it with the line it was for.
    assert all(hits.values()), {pattern: n for pattern, n in hits.items() if not n}


# ---------------------------------------------------------------------------
# Install: every extra a guide needs is named where a new user installs (item 13)
# ---------------------------------------------------------------------------

INSTALL_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")
# The extras a user installs for a part of the package; the rest are the project's own
# (docs, test, ci, all).
USER_EXTRAS = ("client", "megatron", "transformers", "ray", "testing", "bench")


def _extras() -> dict[str, list[str]]:
    """pyproject's optional dependencies: extra -> requirement names."""
    import tomllib

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {k: [re.split(r"[<>=\[ ]", r, maxsplit=1)[0] for r in v] for k, v in table.items()}


def _section(page: str, heading: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_user_extras_are_the_packages_own():
    assert set(USER_EXTRAS) | {"docs", "test", "ci", "all"} == set(_extras())


@pytest.mark.parametrize("page", INSTALL_PAGES)
def test_an_install_section_installs_each_trainers_extras(page):
    """A transformers or Ray user finds their extra where they install, not deep in a guide."""
    section = _section(page, "## Install")
    installs = re.findall(r"pip install [^\n]*?\[([a-z,]+)\]", section)
    named = {e for group in installs for e in group.split(",")}
    assert {"client", "megatron", "transformers"} <= named, f"{page}: the install lines name only {sorted(named)}"
    for extra in ("ray", "testing"):
        assert extra in named or f"`{extra}`" in section, f"{page}: the Install section never names the {extra} extra"


def test_the_extras_table_lists_every_user_extra_and_what_it_installs():
    section = _section("docs/getting-started.md", "## Install")
    rows = dict(re.findall(r"^\| `([a-z]+)` \| ([^|]+) \|", section, re.M))
    assert set(rows) == set(USER_EXTRAS), f"the extras table lists {sorted(rows)}"
    extras = _extras()
    for extra, installs in rows.items():
        for requirement in extras[extra]:
            assert requirement in installs, f"the {extra} row says it installs {installs.strip()!r}, not {requirement}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_installs_an_unpinned_torch(page):
    """An unpinned `pip install torch` may pull a multi-GB CUDA build; the pages pin the tested one."""
    unpinned = re.findall(r"pip install torch(?=\s|$|`)", page.read_text(), re.M)
    assert not unpinned, f"{page.relative_to(ROOT)}: `pip install torch` without a version"


@pytest.mark.parametrize("page", ("README.md", "docs/index.md"))
def test_the_first_paragraphs_name_both_hooks(page):
    intro = (ROOT / page).read_text().split("\n## ", 1)[0]
    assert "Megatron" in intro and "transformers" in intro, f"{page}: the introduction names one trainer only"


# ---------------------------------------------------------------------------
# Files only a checkout has (item 18)
# ---------------------------------------------------------------------------

CHECKOUT_ONLY = re.compile(r"(?<![\w/.-])(?:examples|benchmarks)/[\w./-]+\.py\b")


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_page_that_points_at_an_example_or_benchmark_says_it_is_in_a_checkout(page):
    """The wheel ships neither `examples/` nor `benchmarks/`: a user who installed it must read
    that the file is in a checkout (or on GitHub), next to where the page names it."""
    paragraphs = _paragraphs(page.read_text())
    for k, paragraph in enumerate(paragraphs):
        for path in CHECKOUT_ONLY.findall(paragraph):
            near = " ".join(paragraphs[max(0, k - 1) : k + 2])
            assert "checkout" in near, (
                f"{page.relative_to(ROOT)}: names {path} as if a user had it; say it is in a checkout: {paragraph[:160]!r}"
            )


def test_the_performance_page_gives_the_default_bench_the_readmes_time_and_memory():
    """One figure for how long `torch-r3 bench` takes and how much memory it needs, on both pages."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"the default benchmark then takes about (\d+) s and needs about (\d+(?:\.\d+)?) GiB", readme)
    assert m, "the README no longer states the default benchmark's time and memory"
    performance = (ROOT / "docs" / "performance.md").read_text()
    (line,) = [x for x in performance.splitlines() if x.startswith("torch-r3 bench ") and "the default run" in x]
    assert f"about {m[1]} s" in line and f"about {m[2]} GiB" in line, (line, m[0])


# ---------------------------------------------------------------------------
# The Comparison page says of torch_r3 what the README says (item 12)
# ---------------------------------------------------------------------------

COMPARISON = ROOT / "docs" / "comparison.md"
# The released frameworks and libraries the page compares against, each a row of its table.
COMPARED = ("verl", "slime", "miles", "SkyRL", "NeMo-RL", "AReaL", "prime-rl", "NeMo-Automodel", "`RouterReplay`")


def _glance() -> tuple[list[str], dict[str, list[str]]]:
    """The 'At a glance' table: its column headings and {first cell: the row's cells}."""
    text = COMPARISON.read_text()
    table = text[text.index("## At a glance") :].split("\n\n")[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")]
    return rows[0], {r[0]: r for r in rows[2:]}


def _readme_piece(name: str) -> str:
    """The README's 'What is in the box' row for `name`."""
    readme = (ROOT / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{name}`")]
    return row


def test_the_comparison_covers_every_released_r3_implementation():
    _, rows = _glance()
    for name in COMPARED:
        assert any(name in first for first in rows), f"the Comparison page has no row for {name}"
    assert any("verl 0.9.1" in first for first in rows) and any("SkyRL 0.4.0" in first for first in rows)


def test_the_comparison_says_of_torch_r3_what_the_readme_says():
    heads, rows = _glance()
    (ours,) = [r for first, r in rows.items() if first == "`torch_r3`"]
    cell = dict(zip(heads, ours))
    megatron, transformers = (
        _readme_piece("torch_r3.megatron.ReplayHook"),
        _readme_piece("torch_r3.transformers.ReplayHook"),
    )
    # R2: the README says both hooks record the trainer's own routes.
    assert "R2" in megatron and "R2" in transformers
    assert cell["R2 (trainer-recorded routes)"].startswith("yes"), cell
    # The trainers: Megatron-core and transformers, with the parallelism the README lists.
    trainer = cell["trainer it replays in"]
    assert "Megatron-core" in trainer and "transformers" in trainer
    for words in ("DDP", "FSDP2"):
        assert words in transformers and words in trainer, (words, trainer)
    # Interleaved pipelines: refused, as the README says.
    assert "refuses interleaved pipeline schedules" in megatron
    assert "refused" in cell["interleaved (virtual) pipeline"]
    # And the list of what it does not do denies none of it.
    text = COMPARISON.read_text()
    missing = text[text.index("## What `torch_r3` does not do") :]
    for claim in ("does not do R2", "Megatron-core only", "no FSDP", "no Hugging Face"):
        assert claim not in missing, f"the Comparison page says {claim!r}; the README says otherwise"


def _first_column(page: Path, header: str) -> list[str]:
    """The first-column names (`"name"`) of the table under the header row that starts with `header`."""
    lines = page.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`").strip('"'))
    return rows


@pytest.mark.parametrize(
    ("page", "header"),
    [
        ("docs/guides/inference-server.md", "| `server=` |"),
        ("docs/api/testing.md", "| `protocol` | endpoint |"),
        ("docs/api/testing.md", "| `protocol` | salt field |"),
    ],
)
def test_every_server_table_lists_every_protocol_the_client_and_loopback_take(page, header):
    from torch_r3.rollout.protocols import PROTOCOLS

    assert sorted(_first_column(ROOT / page, header)) == sorted(PROTOCOLS)
