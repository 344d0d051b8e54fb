"""Every fenced ```python block of README.md and docs/**/*.md runs as written.

The blocks of one page run in order, in one namespace, in a fresh interpreter whose working
directory is a temporary folder. A block is skipped only where the line just before its
fence is an HTML comment `<!-- not run: <reason> -->`, and the reason is required. Pages
are discovered, not listed: a new page is covered without an edit here.

A block that ends in a run of whole-line comments after a `print(...)` states its output
there; what it prints must be that text (compared with runs of whitespace collapsed, so a
long line may wrap). A page passes when every block ran without an exception, printed what
it states, raised no deprecation warning (the project's own `filterwarnings` of pyproject.toml
apply, as in the test run: a page never teaches a deprecated spelling), and nothing it
started is still running afterwards: no non-daemon thread, no
child process, and no listening socket (a loopback server left open, whose thread may be a
daemon). The routes a page builds must be ones a router could make: every array it gives
`compact_routes` and every captured row that `collate_routes`, `R3Collator` or
`ShardCollator` returns holds distinct experts per token (a real model refuses a repeated
expert; the collator leaves that check to the hooks). A block with a top-level `await` is refused with a hint: a snippet must run as a
script, so it calls `asyncio.run(...)`.

The parser and marker checks spawn nothing; running the pages does (one interpreter per
page), so those tests are marked slow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*not run\b(?P<rest>.*?)-->\s*$")
PAGE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first code line (the one after the opening fence)
    code: str
    skip_reason: str | None
    stated_output: str | None = None  # the trailing `# ...` lines after a print, comment signs removed


class SnippetError(ValueError):
    """A page whose fences or skip markers cannot be read as the convention says."""


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _marker_reason(line: str, where: str) -> str | None:
    """The reason of a `<!-- not run: reason -->` line; None if the line is no such marker."""
    m = MARKER.match(line)
    if m is None:
        return None
    rest = m["rest"].strip()
    if not rest.startswith(":") or not rest[1:].strip():
        raise SnippetError(f"{where}: a skip marker needs a reason: <!-- not run: <reason> --> (got {line.strip()!r})")
    return rest[1:].strip()


def parse(text: str, name: str) -> list[Block]:
    """The ```python blocks of a Markdown text, with the skip reason of each.

    Fences may be indented (inside a list item or an admonition); the code is dedented by
    the fence's indentation. Raises `SnippetError` for an unclosed fence, a skip marker
    without a reason, or a skip marker that does not stand just before a python block.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, ticks, info = m["indent"], m["ticks"], m["info"].lower()
        close = re.compile(rf"^[ \t]*{re.escape(ticks[0])}{{{len(ticks)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise SnippetError(f"{name}:{i + 1}: the fence opened here is never closed")
        if info in ("python", "py"):
            reason = None
            if i > 0:
                reason = _marker_reason(lines[i - 1], f"{name}:{i}")
                if reason is not None:
                    used_markers.add(i - 1)
            body = [line.removeprefix(indent) for line in lines[i + 1 : j]]
            code = "\n".join(body) + "\n"
            blocks.append(Block(line=i + 2, code=code, skip_reason=reason, stated_output=stated_output(body)))
        i = j + 1
    for k, line in enumerate(lines):
        if k not in used_markers and _marker_reason(line, f"{name}:{k + 1}") is not None:
            raise SnippetError(f"{name}:{k + 1}: a skip marker must be the line just before a ```python fence")
    return blocks


def stated_output(body: list[str]) -> str | None:
    """The output a block states: its trailing whole-line comments, when code before them prints."""
    k = len(body)
    while k > 0 and body[k - 1].lstrip().startswith("#"):
        k -= 1
    if k == len(body) or "print(" not in "\n".join(body[:k]):
        return None
    return "\n".join(line.lstrip()[1:].removeprefix(" ") for line in body[k:])


def warning_filters() -> list[str]:
    """The test run's `filterwarnings` (pyproject.toml): deprecations are errors, a few third-party ones ignored."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# Runs in the page's own interpreter: the blocks in order in one namespace, then checks that
# nothing the page started is left running. Writes its verdict as JSON to argv[1].
RUNNER = textwrap.dedent(
    """
    import ast, contextlib, gc, io, json, multiprocessing, os, sys, threading, traceback

    def listening_ports():
        # A server a block left open (its thread may be a daemon): this process's listening TCP sockets.
        if not os.path.isdir("/proc/self/fd"):
            return []  # no /proc: not checked
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                inodes.add(os.readlink(f"/proc/self/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
            except OSError:
                pass  # the descriptor listdir itself used, closed by now
        ports = []
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                rows = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                f = row.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    ports.append(int(f[1].rsplit(":", 1)[1], 16))
        return sorted(ports)

    def audit_routes():
        # A page's routes must be ones a router could make: K distinct experts per token (a real
        # model refuses "expert 59 twice in one route"; the collator does not check that). Every
        # captured row a page collates is checked, and every array it compacts.
        import functools
        import numpy as np
        import torch_r3, torch_r3.collate, torch_r3.routes, torch_r3.collate.shard

        def check(routes, where):
            a = np.asarray(routes)
            if a.ndim < 2 or a.shape[-1] < 2 or a.size == 0:
                return
            rows = np.sort(a.reshape(-1, a.shape[-1]), axis=-1)
            dup = np.flatnonzero((rows[:, 1:] == rows[:, :-1]).any(axis=-1))
            if dup.size:
                raise AssertionError(
                    f"{where}: a route names one expert twice in a token ({rows[dup[0]].tolist()}); "
                    "a router never does: make routes of distinct experts, e.g. "
                    "np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :topk]"
                )

        def check_batch(out, where):
            routes, mask = out.get("rollout_expert_indices"), out.get("router_padding_mask")
            if routes is None:
                return out
            routes = routes.numpy() if hasattr(routes, "numpy") else routes
            if mask is not None:
                mask = mask.numpy() if hasattr(mask, "numpy") else np.asarray(mask)
                routes = routes[~mask] if mask.shape == routes.shape[: mask.ndim] else routes
            check(routes, where)
            return out

        def wrap(fn, where, result=check_batch):
            @functools.wraps(fn)
            def inner(*args, **kwargs):
                return result(fn(*args, **kwargs), where)
            return inner

        def compacting(fn):
            @functools.wraps(fn)
            def inner(array, *args, **kwargs):
                check(array, "compact_routes")
                return fn(array, *args, **kwargs)
            return inner

        def iterating(fn):
            @functools.wraps(fn)
            def inner(self):
                for out in fn(self):
                    yield check_batch(out, "ShardCollator")
            return inner

        torch_r3.compact_routes = compacting(torch_r3.routes.compact_routes)  # what a page calls, not the codec
        torch_r3.collate_routes = torch_r3.collate.collate_routes = wrap(torch_r3.collate.collate_routes, "collate_routes")
        torch_r3.R3Collator.__call__ = wrap(torch_r3.R3Collator.__call__, "R3Collator")
        torch_r3.ShardCollator.__iter__ = iterating(torch_r3.ShardCollator.__iter__)

    def error_on_deprecations(filters):
        # pyproject.toml's filterwarnings, applied as pytest applies them (a later entry wins).
        import builtins, warnings
        for entry in filters:
            action, message, category, module = (entry.split(":", 4) + [""] * 4)[:4]
            warnings.filterwarnings(action, message, getattr(builtins, category or "Warning"), module)

    spec = json.load(sys.stdin)
    verdict = {"ran": 0, "error": None}
    error_on_deprecations(spec["filterwarnings"])
    namespace = {"__name__": "__main__"}
    try:
        audit_routes()
        for block in spec["blocks"]:
            where = f"{spec['page']}:{block['line']}"
            source = "\\n" * (block["line"] - 1) + block["code"]  # tracebacks show the page's line numbers
            try:
                code = compile(source, spec["page"], "exec")
            except SyntaxError:
                try:
                    compile(source, spec["page"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
                except SyntaxError:
                    raise
                raise SyntaxError(f"{where}: top-level await; a snippet runs as a script: use asyncio.run(...)") from None
            print(f"--- {where}", file=sys.stderr, flush=True)
            if block["stated"] is None:
                exec(code, namespace)
            else:
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(code, namespace)
                sys.stdout.write(out.getvalue())
                if out.getvalue().split() != block["stated"].split():
                    raise AssertionError(
                        f"{where}: the block states that it prints\\n{block['stated']}\\nbut it printed\\n{out.getvalue()}"
                    )
            verdict["ran"] += 1
        namespace.clear()
        gc.collect()
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        if threads:
            raise RuntimeError(f"{spec['page']}: threads still running after the last block: {threads}")
        listening = listening_ports()
        if listening:
            raise RuntimeError(f"{spec['page']}: still listening after the last block on TCP ports {listening}")
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()  # it holds this interpreter's output pipes open
        if children:
            raise RuntimeError(f"{spec['page']}: child processes still running after the last block: {children}")
    except BaseException:
        verdict["error"] = traceback.format_exc()
    with open(sys.argv[1], "w") as f:
        json.dump(verdict, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the verdict is written; do not let a leaked thread hang the interpreter's exit
    """
)


def run_blocks(name: str, blocks: list[Block], workdir: Path, timeout_s: float = PAGE_TIMEOUT_S) -> dict:
    """Run `blocks` in a fresh interpreter in `workdir`; returns {"ran", "error", "output"}."""
    verdict_path = workdir / ".snippet-verdict.json"
    spec = {
        "page": name,
        "blocks": [{"line": b.line, "code": b.code, "stated": b.stated_output} for b in blocks],
        "filterwarnings": warning_filters(),
    }
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"}
    try:
        done = _run_runner(spec, verdict_path, workdir, env, timeout_s)
    except subprocess.TimeoutExpired as e:
        output = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or ""))
        return {"ran": 0, "error": f"{name}: still running after {timeout_s} s", "output": output[-8000:]}
    output = (done.stdout + done.stderr)[-8000:]
    if not verdict_path.exists():
        return {"ran": 0, "error": f"the interpreter died (exit status {done.returncode})", "output": output}
    verdict = json.loads(verdict_path.read_text())
    verdict_path.unlink()
    return {**verdict, "output": output}


def _run_runner(
    spec: dict, verdict_path: Path, workdir: Path, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(verdict_path)],
        check=False,
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=workdir,
        env=env,
    )


def _census(page: Path) -> tuple[list[Block], list[Block]]:
    blocks = parse(page.read_text(), _name(page))
    return [b for b in blocks if b.skip_reason is None], [b for b in blocks if b.skip_reason is not None]


def _page_id(page: Path) -> str:
    run, skipped = _census(page)
    return f"{_name(page)}: {len(run)} run, {len(skipped)} not run"


# ---------------------------------------------------------------------------
# The convention itself (no processes)
# ---------------------------------------------------------------------------


def test_discovery_covers_readme_and_every_docs_page():
    found = {_name(p) for p in pages()}
    assert {"README.md", "docs/index.md", "docs/guides/tutorial-rl-step.md", "docs/api/trace.md"} <= found
    assert found == {"README.md"} | {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_page_parses_and_every_skip_names_its_reason(page):
    blocks = parse(page.read_text(), _name(page))  # raises on a reasonless or stray marker
    for b in blocks:
        assert b.skip_reason is None or len(b.skip_reason) >= 8, f"{_name(page)}:{b.line}: say why it does not run"


# A checkout path a page names (`torch_r3/demo.py`, `tests/gpu/multirank_nccl.sh`), not part of a URL.
CHECKOUT_PATH = re.compile(r"(?<![\w/.-])(?:torch_r3|tests|examples|benchmarks|docs)/[\w./-]+\.(?:py|sh|md|toml|yml)\b")


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_every_file_a_page_names_exists(page):
    missing = sorted({p for p in CHECKOUT_PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{_name(page)} names files the checkout does not have: {missing}"


def test_the_path_pattern_finds_paths_but_not_urls():
    text = "see `torch_r3/demo.py` and tests/gpu/x.sh, not https://github.com/o/torch_r3/blob/main/CHANGELOG.md"
    assert CHECKOUT_PATH.findall(text) == ["torch_r3/demo.py", "tests/gpu/x.sh"]


def test_parse_finds_indented_blocks_and_their_markers():
    text = (
        "intro\n"
        "```python\n"
        "x = 1\n"
        "```\n"
        "- a list item:\n"
        "\n"
        "    <!-- not run: needs a GPU -->\n"
        "    ```python\n"
        "    y = x + 1\n"
        "    ```\n"
        "```bash\n"
        "echo not python\n"
        "```\n"
        "````py\n"
        "z = 3\n"
        "````\n"
    )
    assert parse(text, "t.md") == [
        Block(line=3, code="x = 1\n", skip_reason=None),
        Block(line=9, code="y = x + 1\n", skip_reason="needs a GPU"),
        Block(line=15, code="z = 3\n", skip_reason=None),
    ]


def test_the_output_a_block_states_is_its_trailing_comments_after_a_print():
    assert stated_output(["x = 1", "print(x, [x,", "       x])", "# 1 [1,", "#  1]"]) == "1 [1,\n 1]"
    assert stated_output(["x = 1  # not output", "# a closing remark, no print before it"]) is None
    assert stated_output(["print(1)", "y = 2"]) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- not run -->\n```python\nx = 1\n```\n", "needs a reason"),
        ("<!-- not run:   -->\n```python\nx = 1\n```\n", "needs a reason"),
        ("<!-- not run: a GPU -->\n\n```python\nx = 1\n```\n", "just before"),
        ("<!-- not run: a GPU -->\n```bash\necho\n```\n", "just before"),
        ("```python\nx = 1\n", "never closed"),
    ],
)
def test_parse_refuses_a_marker_without_reason_a_stray_marker_and_an_open_fence(text, message):
    with pytest.raises(SnippetError, match=message):
        parse(text, "t.md")


# ---------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "code, expected",
    [
        ("x = 1\n\n\nassert x == 2\n", 'File "t.md", line 4'),  # the failing line, as the page numbers it
        ("import asyncio\nawait asyncio.sleep(0)\n", "top-level await"),
        (
            "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n",
            "threads still running",
        ),
        ("import multiprocessing, time\nmultiprocessing.Process(target=time.sleep, args=(60,)).start()\n", "child"),
        ("print(1 + 1)\n# 3\n", "states that it prints"),
        (  # a page that teaches a deprecated spelling fails, as the test run's own code would
            "from torch_r3 import R3Collator\nR3Collator(pad_token_id=0, workers=2)\n",
            "DeprecationWarning: R3Collator(workers=) is deprecated",
        ),
        ("from torch_r3.testing import LoopbackServer\nserver = LoopbackServer().start()\n", "still listening"),
        (  # routes no router makes: expert 3 twice in one token, compacted or collated
            "import numpy as np\nfrom torch_r3 import compact_routes\ncompact_routes(np.array([[[3, 3]]]))\n",
            "names one expert twice in a token ([3, 3])",
        ),
        (
            "import numpy as np\nfrom torch_r3 import R3Collator\n"
            "R3Collator(pad_token_id=0)([{'input_ids': [1, 2, 3], 'routes': np.array([[[0, 1]], [[2, 2]]], np.uint8)}])\n",
            "R3Collator: a route names one expert twice in a token ([2, 2])",
        ),
    ],
)
def test_the_runner_reports_a_failure_a_top_level_await_a_leak_and_a_wrong_output(tmp_path, code, expected):
    block = Block(line=1, code=code, skip_reason=None, stated_output=stated_output(code.splitlines()))
    verdict = run_blocks("t.md", [block], tmp_path)
    assert verdict["error"] is not None and expected in verdict["error"], verdict


@pytest.mark.slow
def test_the_runner_stops_a_page_that_hangs(tmp_path):
    # The page prints once its interpreter has started (torch imported) and then hangs. A loaded
    # machine can spend the whole time-out starting the interpreter: then the verdict is still
    # "still running" but nothing was printed yet, and the check repeats with twice the time-out.
    page = [Block(1, "print('started', flush=True)\nimport time\ntime.sleep(600)\n", None)]
    for timeout_s in (3, 6, 12, 24, 48):
        verdict = run_blocks("t.md", page, tmp_path, timeout_s)
        assert f"still running after {timeout_s} s" in verdict["error"], verdict
        if "started" in verdict["output"]:
            break
    assert "started" in verdict["output"], verdict


@pytest.mark.slow
def test_the_runner_shares_one_namespace_per_page_in_order(tmp_path):
    blocks = [Block(1, "x = 2\n", None), Block(5, "assert x == 2\nopen('here', 'w').close()\n", None)]
    verdict = run_blocks("t.md", blocks, tmp_path)
    assert verdict["error"] is None and verdict["ran"] == 2, verdict
    assert (tmp_path / "here").exists()  # the working directory is the temporary one


WITH_BLOCKS = [p for p in pages() if any(_census(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", WITH_BLOCKS, ids=_page_id)
def test_page_snippets_run_as_written(page, tmp_path):
    run, skipped = _census(page)
    if not run:
        return  # every block is marked not run (the id says how many); nothing to start
    verdict = run_blocks(_name(page), run, tmp_path)
    assert verdict["error"] is None, (
        f"{_name(page)}: {verdict['ran']} of {len(run)} blocks ran before the failure\n"
        f"{verdict['error']}\n--- output ---\n{verdict['output']}"
    )
    assert verdict["ran"] == len(run)
    print(f"{_name(page)}: {verdict['ran']} blocks ran, {len(skipped)} not run")
