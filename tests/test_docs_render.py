"""The documentation renders what the docstrings mean, and its quickstart runs.

`mkdocs build --strict` passes on pages that render badly: an RST role such as
``:func:`x` `` shows as literal text, and a `>>>` example outside an `Examples:`
section becomes nested blockquotes. This builds the site once and reads the HTML.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RST_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?=\s*(?:<code|`))")
# `>>> x` rendered as Markdown: three nested blockquotes, or one that starts with the prompt.
BLOCKQUOTED_PROMPT = re.compile(r"<blockquote>\s*(?:<blockquote>\s*<blockquote>|<p>\s*&gt;&gt;&gt;)")
SECTION = re.compile(
    r'doc-section-title">(?P<title>[^<]*)</span></p>\s*<table>.*?<tbody>(?P<rows>.*?)</tbody>', re.DOTALL
)


@pytest.fixture(scope="module")
def site(built_site: Path) -> dict[str, str]:
    """Every page of the built site: its path (e.g. `api/collate/`) -> its HTML."""
    pages = {p.parent.relative_to(built_site).as_posix() + "/": p.read_text() for p in built_site.rglob("index.html")}
    assert "api/collate/" in pages and "./" in pages
    return pages


def _offences(site: dict[str, str], pattern: re.Pattern) -> dict[str, int]:
    return {page: n for page, html in sorted(site.items()) if (n := len(pattern.findall(html)))}


def test_no_page_shows_a_literal_rst_role(site):
    offences = _offences(site, RST_ROLE)
    assert not offences, f"literal :func:/:class:/... roles (use Markdown backticks) per page: {offences}"


def test_no_page_renders_a_doctest_prompt_as_a_blockquote(site):
    offences = _offences(site, BLOCKQUOTED_PROMPT)
    assert not offences, f"'>>>' rendered as blockquotes (the docstring needs 'Examples:') per page: {offences}"


def test_snippet_skip_markers_stay_invisible_html_comments(site):
    # `<!-- not run: reason -->` before a fence (tests/test_docs_snippets.py) must not show as text.
    shown = {page: n for page, html in sorted(site.items()) if (n := html.count("&lt;!-- not run"))}
    assert not shown, f"skip markers rendered as text, per page: {shown}"
    assert any("<!-- not run:" in html for html in site.values()), "no page carries a skip marker any more"


def test_every_returns_section_is_one_entry(site):
    split = {
        page: n
        for page, html in sorted(site.items())
        if (n := sum(m["rows"].count("<tr") > 1 for m in SECTION.finditer(html) if m["title"] == "Returns:"))
    }
    assert not split, f"Returns sections split into several rows, per page: {split}"


def _object_html(html: str, identifier: str) -> str:
    start = html.index(f'id="{identifier}"')
    end = html.find('<div class="doc doc-object', start)
    return html[start:] if end < 0 else html[start:end]


def test_r3collator_shows_its_signature_and_every_constructor_parameter(site):
    from torch_r3 import R3Collator

    names = list(inspect.signature(R3Collator).parameters)
    html = _object_html(site["api/collate/"], "torch_r3.R3Collator")
    assert "doc-signature" in html, "R3Collator shows no signature"
    signature = html[html.index("doc-signature") :]
    signature = signature[: signature.index("</pre>")]
    assert all(f'<span class="n">{name}</span>' in signature for name in names)
    tables = {m["title"]: m["rows"] for m in SECTION.finditer(html)}
    assert "Parameters:" in tables, "R3Collator documents no parameters"
    # `**deprecated` (the old keywords, each warned) is rendered with its stars
    documented = re.findall(r'doc-section-item">\s*<td>\s*<code>(?:\*\*)?(\w+)</code>', tables["Parameters:"])
    assert documented == names


def test_home_page_quickstart_prints_what_it_says():
    home = (ROOT / "docs" / "index.md").read_text()
    section = home[home.index("## Quickstart") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]
    claimed = [line[2:] for line in code.splitlines() if line.startswith("# ")]
    assert 0 < len(code.splitlines()) <= 12 and claimed, "a short quickstart that states its output"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/index.md", "exec"), {})
    assert out.getvalue().splitlines() == claimed
