"""The package as a user receives it: the wheel's contents and the extras' messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import torch_r3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """`pip wheel .` of a copy of the sources (the checkout stays clean), offline."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "torch_r3", src / "torch_r3", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("torch_r3-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith("/" + name)]
    return wheel.read(path).decode()


def test_wheel_carries_py_typed_and_the_license(wheel):
    names = wheel.namelist()
    assert "torch_r3/py.typed" in names
    assert _dist_info(wheel, "LICENSE") == (ROOT / "LICENSE").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_wheel_carries_every_module_of_the_package_and_nothing_else(wheel):
    shipped = {n for n in wheel.namelist() if n.endswith(".py")}
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torch_r3").rglob("*.py")}
    assert shipped == sources  # the demo and its CPU redirections included; no tests/, no examples/
    assert "torch_r3/demo/megatron.py" in shipped and "torch_r3/megatron/_cpu.py" in shipped


def test_wheel_metadata_names_version_license_extras_and_urls(wheel):
    meta = Parser().parsestr(_dist_info(wheel, "METADATA"))
    assert meta["Version"] == torch_r3.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert {"client", "megatron", "testing"} <= set(meta.get_all("Provides-Extra"))
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Documentation", "Repository", "Issues", "Changelog"} <= set(urls)
    assert "Typing :: Typed" in meta.get_all("Classifier")
    entry_points = _dist_info(wheel, "entry_points.txt")
    assert "torch-r3 = torch_r3.cli:main" in entry_points


INSTALL_PAGES = ("README.md", "docs/index.md", "docs/getting-started.md")


def _index_line(version: str) -> re.Pattern:
    return re.compile(rf"pip install 'torch_r3(\[[a-z,]+\])?=={re.escape(version)}'")


def test_install_lines_pin_the_version_the_changelog_describes():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{torch_r3.__version__}]" in changelog
    for page in INSTALL_PAGES:
        assert _index_line(torch_r3.__version__).search((ROOT / page).read_text()), (
            f"{page} has no install line pinned to this version"
        )


def _install_section(page: str) -> str:
    text = (ROOT / page).read_text()
    start = text.index("## Install")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


@pytest.mark.parametrize("page", INSTALL_PAGES)
def test_install_sections_give_a_working_install_before_the_unpublished_index_line(page):
    """The version is not on the package index: a page leads with what works, a checkout or a wheel."""
    section = _install_section(page)
    index_line = _index_line(torch_r3.__version__).search(section)
    assert index_line, f"{page}: the Install section lost the index line"
    working = re.search(r"pip install (-e )?'(\.|dist/torch_r3-[^']+\.whl)\[[a-z,]+\]'", section)
    assert working and working.start() < index_line.start(), (
        f"{page}: no checkout or wheel install before the index line"
    )
    assert "not on the package index yet" in section, f"{page}: say that the index line does not work yet"


def test_the_documented_wheel_name_is_the_one_pip_builds(wheel):
    built = Path(wheel.filename).name
    for page in INSTALL_PAGES:
        for named in re.findall(r"dist/(torch_r3-[^'\s\[]+\.whl)", (ROOT / page).read_text()):
            assert named == built, f"{page} names {named}; make dist builds {built}"


# What the installed package says about itself, from outside the checkout: its version and
# place, and the strategies its benchmark knows (torch_r3's own and the floors, no peer).
INSTALLED_PROBE = """
import json, torch_r3, torch_r3.demo, torch_r3.cli
from torch_r3 import bench
print(json.dumps({"version": torch_r3.__version__, "file": torch_r3.__file__,
                  "registered": list(bench.registered()), "strategies": list(bench.STRATEGIES)}))
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, object]:
    """`pip install` of the built wheel (no index, no dependencies: torch and numpy are here) into a fresh target."""
    tmp_path = tmp_path_factory.mktemp("installed")
    target = tmp_path / "site"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            wheel.filename,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return {"target": target, "cwd": tmp_path, "env": env, **json.loads(done.stdout.strip().splitlines()[-1])}


def test_the_wheel_installs_and_its_entry_point_runs_outside_the_checkout(installed):
    target = installed["target"]
    assert installed["version"] == torch_r3.__version__ and Path(installed["file"]).is_relative_to(target)
    done = subprocess.run(
        [str(target / "bin" / "torch-r3"), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=installed["cwd"],
        env=installed["env"],
    )
    assert done.returncode == 0, done.stderr
    assert all(command in done.stdout for command in ("bench", "doctor", "demo"))


def test_the_wheel_ships_the_product_s_strategies_and_no_peer_s(wheel, installed):
    """The peers' collations (`benchmarks/peers.py`) are comparisons: they stay in the checkout."""
    from benchmarks import peers
    from torch_r3 import bench

    peer_names = {p.name for p in peers.PEERS}
    assert installed["registered"] == installed["strategies"] == list(bench.STRATEGIES)
    assert not peer_names & set(installed["registered"])
    assert not any(n.startswith("benchmarks/") for n in wheel.namelist())
    sources = {n: wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".py")}
    for peer in peers.PEERS:
        defined = [n for n, text in sources.items() if f"def {peer.call.__name__}(" in text]
        assert not defined, f"the wheel implements the peer {peer.name!r} in {defined}"


# What `import torch_r3` must work without, and the part of it that needs each extra. One
# fresh interpreter checks every case (importing torch costs seconds per interpreter): first
# the core and its framework-free modules with every extra installed, recording which optional
# modules they pulled in (one never imported is one the import works without); then, with
# every extra blocked, each part that needs one, recording the error it raised.
OPTIONAL = ("aiohttp", "megatron", "ray", "transformers")
CORE_IMPORTS = (
    "import torch_r3",
    "torch_r3.collate_routes, torch_r3.decode_routes",  # an eager name and a lazy one of the codec
    "import torch_r3.rollout.codec, torch_r3.rollout.trace, torch_r3.distributed, torch_r3.cpu",
)
PARTS = {  # statement -> (what is missing, the extra that installs it)
    "import torch_r3.megatron": ("megatron-core", "megatron"),
    "import torch_r3.rollout.client": ("aiohttp", "client"),
    "from torch_r3 import RemoteGenerateClient": ("aiohttp", "client"),
    "import torch_r3.testing": ("aiohttp", "testing"),
    "import torch_r3.ray": ("ray", "ray"),
    "import torch_r3.transformers": ("transformers", "transformers"),
}
IMPORT_REPORT = f"""
import json, sys
report = {{}}
for statement in {CORE_IMPORTS!r}:
    exec(statement)
report["core"] = sorted(m for m in {(*OPTIONAL, "torch_r3.rollout.client")!r} if m in sys.modules)
from torch_r3 import cli
cli.doctor_report()
report["doctor"] = sorted(m for m in {(*OPTIONAL, "torch_r3.bench")!r} if m in sys.modules)
for name in {OPTIONAL!r}:
    sys.modules[name] = None
for statement in {list(PARTS)!r}:
    try:
        exec(statement, {{}})
        report[statement] = "imported"
    except BaseException as e:  # what the traceback's last line would say
        report[statement] = f"{{type(e).__module__}}.{{type(e).__qualname__}}: {{e}}"
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def import_report() -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_REPORT], check=False, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_torch_r3_and_its_framework_free_modules_import_no_optional_dependency(import_report):
    """So they work without any extra: neither aiohttp, Megatron, Ray nor transformers is
    imported, and the client stays unimported until its name is used."""
    assert import_report["core"] == [], f"{CORE_IMPORTS} imported {import_report['core']}"


def test_doctor_imports_neither_the_benchmark_nor_an_optional_dependency(import_report):
    assert import_report["doctor"] == []


@pytest.mark.parametrize("statement, missing, extra", [(k, *v) for k, v in PARTS.items()], ids=list(PARTS))
def test_a_missing_extra_names_the_command_that_installs_it(import_report, statement, missing, extra):
    assert import_report[statement] == (
        f"torch_r3._extras.MissingExtraError: {missing} is not installed: pip install 'torch_r3[{extra}]'"
    )
