"""The API reference as rendered: Sphinx roles become code that links to documented objects."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PAGES = ["reference/api/index.html", "reference/hooks/index.html"]
LEFTOVER_ROLE = re.compile(r":(?:py:)?(?:func|class|data|attr|meth|mod|exc|obj|const|type):")

needs_mkdocs = pytest.mark.skipif(
    shutil.which("mkdocs") is None and not Path(sys.executable).with_name("mkdocs").exists(),
    reason="mkdocs is not installed",
)


def load_extension() -> ModuleType:
    """The griffe extension that ``mkdocs.yml`` names, loaded from its file."""
    pytest.importorskip("griffe")
    path = ROOT / "docs" / "extensions" / "sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("sphinx_roles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("content", "markdown"),
    [
        ("plan", '<autoref identifier="pkg.Adapter.plan" optional>`plan`</autoref>'),
        ("~pkg.mod.Adapter", '<autoref identifier="pkg.mod.Adapter" optional>`Adapter`</autoref>'),
        (
            "Adapter.plan()",
            '<autoref identifier="pkg.Adapter.plan" optional>`Adapter.plan()`</autoref>',
        ),
        (
            "the adapters <list_adapters>",
            '<autoref identifier="pkg.list_adapters" optional>`the adapters`</autoref>',
        ),
        ("!plan", "`plan`"),
    ],
)
def test_a_role_becomes_code_in_an_optional_reference(content: str, markdown: str) -> None:
    names = {
        "plan": "pkg.Adapter.plan",
        "Adapter": "pkg.Adapter",
        "list_adapters": "pkg.list_adapters",
    }

    def resolve(name: str) -> str:
        head, dot, rest = name.partition(".")
        return names.get(head, head) + dot + rest

    assert load_extension().render_role(content, resolve) == markdown


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built with ``mkdocs build --strict``."""
    directory = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


@needs_mkdocs
@pytest.mark.parametrize("page", REFERENCE_PAGES)
def test_no_sphinx_role_survives_in_the_reference(site: Path, page: str) -> None:
    html = (site / page).read_text()
    leftovers = [html[m.start() : m.end() + 60] for m in LEFTOVER_ROLE.finditer(html)]
    assert leftovers == []


@needs_mkdocs
def test_roles_link_to_documented_objects_and_tilde_shortens_the_name(site: Path) -> None:
    html = (site / "reference/api/index.html").read_text()

    def link(anchor: str, text: str) -> re.Pattern[str]:
        return re.compile(
            rf'<a class="autorefs[^"]*"[^>]*href="#{anchor}"[^>]*><code>{text}</code>'
        )

    assert link(r"layergraph\.plugins\.list_adapters", r"layergraph\.list_adapters").search(html)
    assert link(r"layergraph\.adapter\.Adapter", "Adapter").search(html)
    assert link(r"layergraph\.adapter\.CapturePlan\.bound", "bound").search(html)
    assert link(r"layergraph\.keys\.CallInputs\.argument", "argument").search(html)


@needs_mkdocs
def test_call_inputs_reference_shows_its_members(site: Path) -> None:
    html = (site / "reference/api/index.html").read_text()
    for member in ("argument", "tensors", "batch", "signature", "rebuild", "sliced"):
        assert f'id="layergraph.keys.CallInputs.{member}"' in html, member
