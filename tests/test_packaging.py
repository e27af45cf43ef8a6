"""The distribution ships every package of the source tree, not only the top-level ones."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_for_setuptools() -> None:
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    directories = {name: ROOT / path for name, path in settings["package-dir"].items()}
    found = {
        ".".join((top, *init.parent.relative_to(directory).parts))
        for top, directory in directories.items()
        for init in directory.rglob("__init__.py")
    }
    assert sorted(settings["packages"]) == sorted(found)


def test_the_pytest_plugin_imports_nothing_heavy() -> None:
    """A pytest run where layergraph is installed loads the plugin, and with it neither
    layergraph nor PyTorch, until a test asks for one of its fixtures."""
    import subprocess
    import sys

    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry["pytest11"] == {"layergraph": "layergraph_pytest"}
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, layergraph_pytest; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "'torch'" not in loaded and "'layergraph'" not in loaded
