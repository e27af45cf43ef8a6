"""The transformers releases the transformers adapters accept, and the refusal of others."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layergraph import AdapterMismatch
from layergraph_adapters.versions import (
    TRANSFORMERS_CHECKED,
    UNCHECKED_VARIABLE,
    require_transformers,
)

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """``monkeypatch``, with the unchecked-transformers variable unset."""
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    return monkeypatch


@pytest.mark.parametrize("version", ["5.6.0", "5.17.0", "5.24.0", "5.24.3", "5.20.0.dev0"])
def test_checked_releases_pass(installed: pytest.MonkeyPatch, version: str) -> None:
    installed.setattr(transformers, "__version__", version)
    require_transformers("siglip")


@pytest.mark.parametrize(
    "version", ["4.57.6", "5.5.4", "5.6.0rc1", "5.25.0.dev0", "5.25.0", "6.0.0"]
)
def test_other_releases_are_refused_naming_version_range_and_way_out(
    installed: pytest.MonkeyPatch, version: str
) -> None:
    installed.setattr(transformers, "__version__", version)
    with pytest.raises(AdapterMismatch) as refusal:
        require_transformers("internvl")
    message = str(refusal.value)
    assert "internvl adapter" in message
    assert f"transformers {version} is installed" in message
    assert f"pip install 'transformers{TRANSFORMERS_CHECKED}'" in message
    assert f"{UNCHECKED_VARIABLE}=1" in message


def test_the_variable_lets_an_unchecked_release_run(installed: pytest.MonkeyPatch) -> None:
    installed.setattr(transformers, "__version__", "5.5.4")
    installed.setenv(UNCHECKED_VARIABLE, "1")
    require_transformers("clip")


def test_the_installed_release_is_a_checked_one(installed: pytest.MonkeyPatch) -> None:
    require_transformers("clip")


def test_the_package_extra_asks_for_the_checked_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["transformers"] == [
        f"transformers{TRANSFORMERS_CHECKED}"
    ]


def test_ci_runs_the_adapters_tests_with_the_lowest_checked_release() -> None:
    pinned = re.findall(r'"transformers==([^"]+)"', (ROOT / ".ci" / "run").read_text())
    assert len(pinned) == 1
    assert TRANSFORMERS_CHECKED.startswith(f">={pinned[0]},")
