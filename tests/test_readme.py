"""The README's commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_a_demo_and_a_test_command() -> None:
    demo, tests = readme_commands()
    assert "layergraph demo" in demo
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command() -> None:
    _, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_quick_check_is_documented_and_leaves_out_the_slow_tests() -> None:
    import conftest

    readme = (ROOT / "README.md").read_text()
    assert '.venv/bin/python -m pytest -m "not slow"' in readme
    tests = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert tests >= conftest.SLOW_FILES, conftest.SLOW_FILES - tests
    assert "slow:" in (ROOT / "pyproject.toml").read_text()
