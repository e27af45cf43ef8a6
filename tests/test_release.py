"""What a release promises, checked from the repository: one version everywhere, a dated
changelog section for it, deprecations that name a later release, and a license shipped."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.version import Version

import layergraph

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent


def released(text: str) -> list[tuple[str, str]]:
    """The changelog's released sections, newest first: (version, date)."""
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)


def test_the_version_is_the_same_everywhere() -> None:
    current = Version(layergraph.__version__)
    assert installed_version("layergraph") == layergraph.__version__  # the package metadata
    printed = subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert layergraph.__version__ in printed
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "layergraph.version.__version__"
    }
    sections = released((ROOT / "CHANGELOG.md").read_text())
    newest = Version(sections[0][0])
    # a release's version, or the next one's development version after it
    assert current == newest or (current.is_devrelease and current > newest)


def test_the_changelog_has_an_unreleased_section_above_dated_releases() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## .*$", text, re.M)
    assert headings[0] == "## [Unreleased]"
    sections = released(text)
    assert len(sections) == len(headings) - 1  # every other section is a dated release
    versions = [Version(number) for number, _ in sections]
    assert versions == sorted(versions, reverse=True)


def test_every_deprecation_names_a_later_release_for_its_removal() -> None:
    current = Version(layergraph.__version__)
    removals = set()
    for path in [*(ROOT / "layergraph").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        text = path.read_text()
        removals.update(re.findall(r"(?:goes|go) in (?:layergraph )?(\d+\.\d+)", text))
        removals.update(re.findall(r"until (?:layergraph )?(\d+\.\d+)", text))
    assert removals, "no deprecation names its removal"
    assert all(Version(release) > current for release in removals), removals


def test_the_license_is_apache_and_ships_with_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyproject["license"] == "Apache-2.0" and pyproject["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text


def test_a_deprecation_is_shown_by_default_in_a_plain_script(tmp_path: Path) -> None:
    """No ``-W`` flag: a ``DeprecationWarning`` would be hidden here."""
    script = tmp_path / "service.py"
    script.write_text("import layergraph.serving\n\nlayergraph.serving.ImageEncoder\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert "LayergraphDeprecationWarning: layergraph.serving.ImageEncoder is" in done.stderr
    assert "goes in 0.3" in done.stderr
