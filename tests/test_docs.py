"""The docs: the site builds strictly, every tutorial code block runs, hooks are documented."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import layergraph.hookspecs as hookspecs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE_PAGES = [
    "index.md",
    "troubleshooting.md",
    *(f"tutorials/{page.name}" for page in sorted((DOCS / "tutorials").glob("*.md"))),
]
FENCE = re.compile(r"(<!-- no-test:[^>]*-->\s*)?```python\n(.*?)```", re.S)
INCLUDE = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def python_blocks(page: str) -> list[str]:
    """The page's Python code blocks, includes expanded, without those marked ``no-test``."""
    text = (DOCS / page).read_text()
    blocks = []
    for skipped, code in FENCE.findall(text):
        if skipped:
            continue
        blocks.append(INCLUDE.sub(lambda m: (ROOT / m.group(1)).read_text(), code))
    return blocks


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_every_code_block_of_a_page_runs(page: str, fresh_registry: None) -> None:
    blocks = python_blocks(page)
    assert blocks, f"{page} has no Python code block"
    namespace: dict[str, object] = {"__name__": f"docs.{page}"}
    for number, code in enumerate(blocks, 1):
        try:
            exec(compile(code, f"{page} block {number}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page}, code block {number} failed: {error!r}") from error


def hook_signature(name: str) -> str:
    spec = inspect.signature(getattr(hookspecs, name))
    parameters = ", ".join(f"{p.name}: {p.annotation}" for p in spec.parameters.values())
    return f"def {name}({parameters}) -> {spec.return_annotation}"


def test_hook_reference_gives_every_hook_with_its_exact_signature() -> None:
    page = (DOCS / "reference" / "hooks.md").read_text()
    specified = sorted(
        name
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, "layergraph_spec")
    )
    documented = sorted(re.findall(r"^def (\w+)\(", page, flags=re.M))
    assert documented == specified
    for name in specified:
        assert hook_signature(name) in page, f"the reference's signature of {name} is stale"
        firstresult = getattr(hookspecs, name).layergraph_spec["firstresult"]
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert ("first non-`None` result wins" in row) == firstresult


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not Path(sys.executable).with_name("mkdocs").exists(),
    reason="mkdocs is not installed",
)
def test_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "tutorials" / "writing-an-adapter" / "index.html").exists()
