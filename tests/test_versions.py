"""The transformers releases the transformers adapters accept, and the refusal of others."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from layergraph import AdapterMismatch, LayergraphDeprecationWarning
from layergraph_adapters.kit.versions import (
    TRANSFORMERS_CHECKED,
    UNCHECKED_VARIABLE,
    require_transformers,
)

pytest.importorskip("transformers")

QWEN2_VL_CHECKED = ">=5.17.0,<5.25"
"""The qwen2_vl family's range, as its record states it."""

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Pretend a transformers release is installed, with the unchecked-transformers variable
    unset: the version is set on the module ``import transformers`` gives at the time (importing
    some of transformers' modules replaces it in ``sys.modules``)."""
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)

    def pretend(version: str) -> None:
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)

    return pretend


@pytest.mark.parametrize("version", ["5.6.0", "5.17.0", "5.24.0", "5.24.3", "5.20.0.dev0"])
def test_checked_releases_pass(installed: Callable[[str], None], version: str) -> None:
    installed(version)
    require_transformers("siglip")


@pytest.mark.parametrize(
    "version", ["4.57.6", "5.5.4", "5.6.0rc1", "5.25.0.dev0", "5.25.0", "6.0.0"]
)
def test_other_releases_are_refused_naming_version_range_and_way_out(
    installed: Callable[[str], None], version: str
) -> None:
    installed(version)
    with pytest.raises(AdapterMismatch) as refusal:
        require_transformers("internvl")
    message = str(refusal.value)
    assert "internvl adapter" in message
    assert f"transformers {version} is installed" in message
    assert f"pip install 'transformers{TRANSFORMERS_CHECKED}'" in message
    assert f"{UNCHECKED_VARIABLE}=1" in message


@pytest.mark.parametrize(
    ("version", "accepted"),
    [("5.6.0", False), ("5.16.1", False), ("5.17.0", True), ("5.24.0", True), ("5.25.0", False)],
)
def test_qwen2_vl_asks_for_the_releases_whose_towers_take_precomputed_arguments(
    installed: Callable[[str], None], version: str, accepted: bool
) -> None:
    installed(version)
    if accepted:
        require_transformers("qwen2_vl", QWEN2_VL_CHECKED)
        return
    with pytest.raises(AdapterMismatch) as refusal:
        require_transformers("qwen2_vl", QWEN2_VL_CHECKED)
    assert f"pip install 'transformers{QWEN2_VL_CHECKED}'" in str(refusal.value)


def test_the_variable_lets_an_unchecked_release_run(
    installed: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    installed("5.5.4")
    monkeypatch.setenv(UNCHECKED_VARIABLE, "1")
    require_transformers("clip")


def test_the_installed_release_is_a_checked_one(installed: Callable[[str], None]) -> None:
    require_transformers("clip")


def test_the_package_extra_asks_for_the_checked_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["transformers"] == [
        f"transformers{TRANSFORMERS_CHECKED}"
    ]


def test_the_version_table_names_copies_that_exist_and_tests_that_check_them() -> None:
    import importlib
    from pathlib import Path

    from layergraph_adapters.kit.versions import SUPPORT

    root = Path(__file__).resolve().parent.parent
    for family, support in SUPPORT.items():
        assert support.tests, family
        for test in support.tests:
            assert (root / test).is_file(), (family, test)
        for copy in support.copies:
            module, _, path = copy.partition(":")
            target: object = importlib.import_module(module)
            for name in path.split("."):
                target = getattr(target, name)
            assert callable(target), (family, copy)


def test_ci_runs_each_familys_tests_with_its_oldest_release() -> None:
    from layergraph_adapters.kit.versions import SUPPORT, floors
    from layergraph_adapters.qwen2_vl import QWEN_SUPPORT

    by_release = floors()
    assert list(by_release) == sorted(by_release, key=lambda r: tuple(map(int, r.split("."))))
    for support in SUPPORT.values():
        assert set(support.tests) <= set(by_release[support.floor])
    assert SUPPORT["qwen2_vl"] is QWEN_SUPPORT
    assert SUPPORT["qwen2_vl"].floor == "5.17.0"
    assert TRANSFORMERS_CHECKED.startswith(f">={SUPPORT['transformers towers'].floor},")
    printed = subprocess.run(
        [sys.executable, "-m", "layergraph_adapters.kit.versions"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [line.split()[0] for line in printed] == list(by_release)  # as CI reads it
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m layergraph_adapters.kit.versions" in ci and '"transformers==$release"' in ci


def test_the_qwen_records_state_their_range() -> None:
    from layergraph_adapters.qwen2_vl import QWEN_SUPPORT, Qwen2VLAdapter

    assert QWEN_SUPPORT.checked == QWEN2_VL_CHECKED
    assert all(family.checked == family.support.checked for family in Qwen2VLAdapter.families)


@pytest.mark.parametrize(
    ("old", "family"),
    [
        ("QWEN2_VL_CHECKED", "qwen2_vl"),
        ("PIXTRAL_CHECKED", "pixtral"),
        ("GLM_VISION_CHECKED", "glm vision"),
    ],
)
def test_the_old_range_constants_warn_and_read_the_records(old: str, family: str) -> None:
    import layergraph_adapters.kit.versions as versions

    with pytest.warns(
        LayergraphDeprecationWarning, match=f"{old} is the {family} family's support"
    ):
        value = getattr(versions, old)
    assert value == versions.support_table()[family].checked
