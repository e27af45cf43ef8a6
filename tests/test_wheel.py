"""The built distributions, as a user installs them: a wheel and an sdist built from a copy of
the tree (setuptools' own build hooks, nothing downloaded) hold both packages, every module,
their type markers, the command and every entry point, and the wheel installs into a fresh
virtual environment (without its dependencies, which the test leaves to pip)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SKIPPED = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "site", "results")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel and the sdist built from a copy of the source tree."""
    work = tmp_path_factory.mktemp("build")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*SKIPPED))
    out = work / "dist"
    out.mkdir()
    build = (
        "import pathlib, sys; from setuptools import build_meta as b; "
        "out, record = sys.argv[1:3]; "  # the build hooks set sys.argv for setup.py
        "names = [b.build_wheel(out), b.build_sdist(out)]; "
        "pathlib.Path(record).write_text(' '.join(names))"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(out), str(work / "names.txt")],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, sdist = (work / "names.txt").read_text().split()
    return out / wheel, out / sdist


def source_modules() -> set[str]:
    """Every module of both packages, as paths inside an installed tree."""
    found = set()
    for name, directory in PROJECT["tool"]["setuptools"]["package-dir"].items():
        for path in (ROOT / directory).rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.add(f"{name}/{path.relative_to(ROOT / directory).as_posix()}")
    return found


def version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "layergraph" / "version.py").read_text(), namespace)
    return namespace["__version__"]


def test_the_wheel_holds_every_module_the_command_and_the_entry_points(
    dists: tuple[Path, Path],
) -> None:
    wheel, _ = dists
    assert wheel.name.startswith(f"layergraph-{version()}-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
        entry_points = archive.read(info).decode()
        metadata = archive.read(info.replace("entry_points.txt", "METADATA")).decode()
    assert source_modules() <= names
    assert {"layergraph/py.typed", "layergraph_adapters/py.typed"} <= names
    for name, target in PROJECT["project"]["entry-points"]["layergraph"].items():
        assert f"{name} = {target}" in entry_points
    assert "layergraph = layergraph.cli:main" in entry_points
    assert f"Version: {version()}" in metadata
    for requirement in PROJECT["project"]["dependencies"]:
        assert f"Requires-Dist: {requirement}" in metadata
    for extra in PROJECT["project"]["optional-dependencies"]:
        assert f"Provides-Extra: {extra}" in metadata


def test_the_sdist_holds_what_the_wheel_is_built_from(dists: tuple[Path, Path]) -> None:
    _, sdist = dists
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("pyproject.toml", "README.md", "layergraph/version.py", "adapters/py.typed"):
        assert needed in names
    directories = PROJECT["tool"]["setuptools"]["package-dir"]
    for module in source_modules():
        top, rest = module.split("/", 1)
        assert f"{directories[top]}/{rest}" in names, module


def test_the_wheel_installs_into_a_fresh_environment(
    dists: tuple[Path, Path], tmp_path: Path
) -> None:
    wheel, _ = dists
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (env / "bin" / "layergraph").is_file()
    probe = (
        "import importlib.metadata as m; "
        "print(m.version('layergraph')); "
        "print(' '.join(sorted(e.name for e in m.entry_points(group='layergraph')))); "
        "print(' '.join(sorted(str(f) for f in m.files('layergraph'))))"
    )
    out = subprocess.run(  # away from the source tree, whose egg-info Python would find
        [str(python), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.splitlines()
    assert out[0] == version()
    assert out[1].split() == sorted(PROJECT["project"]["entry-points"]["layergraph"])
    assert source_modules() <= set(out[2].split())
