"""The package as a user receives it: the wheel's contents and the extras' messages."""

from __future__ import annotations

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


def test_the_wheel_installs_and_its_entry_point_runs_outside_the_checkout(wheel, tmp_path):
    """`pip install` of the built wheel (no index, no dependencies: torch and numpy are here) into a fresh target."""
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
    code = "import torch_r3, torch_r3.demo, torch_r3.cli; print(torch_r3.__version__, torch_r3.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    version, location = done.stdout.split()
    assert version == torch_r3.__version__ and Path(location).is_relative_to(target)
    done = subprocess.run(
        [str(target / "bin" / "torch-r3"), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert all(command in done.stdout for command in ("bench", "doctor", "demo"))


def _import_without(blocked: list[str], statement: str) -> subprocess.CompletedProcess:
    """Run `statement` in a fresh interpreter where the `blocked` modules cannot be imported."""
    code = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n{statement}"
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)


def test_import_torch_r3_needs_neither_megatron_nor_aiohttp():
    done = _import_without(["megatron", "aiohttp"], "import torch_r3\nprint(torch_r3.collate_routes.__name__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "collate_routes"


@pytest.mark.parametrize(
    "blocked, statement, command",
    [
        (["megatron"], "import torch_r3.megatron", "pip install 'torch_r3[megatron]'"),
        (["aiohttp"], "import torch_r3.client", "pip install 'torch_r3[client]'"),
        (["aiohttp"], "from torch_r3 import RemoteGenerateClient", "pip install 'torch_r3[client]'"),
        (["aiohttp"], "import torch_r3.testing", "pip install 'torch_r3[testing]'"),
    ],
)
def test_a_missing_extra_names_the_command_that_installs_it(blocked, statement, command):
    done = _import_without(blocked, statement)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_r3._extras.MissingExtraError: ") and last.endswith(command), last
