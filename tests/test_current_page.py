"""docs/benchmarks.md is written from its runs' JSON, and its tables are narrow enough to read
without scrolling (the site's test renders it at 1280 px in a browser)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def current_page(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("current_page")


def test_the_page_is_what_its_runs_json_gives(current_page: Any) -> None:
    assert current_page.main(["--check"]) == 0
    for run in current_page.RUNS:
        assert f"(results/{run.path})" in current_page.PAGE.read_text()


def test_its_tables_are_short_rows_of_short_cells(current_page: Any) -> None:
    rows = [line for line in current_page.page().splitlines() if line.startswith("|")]
    assert rows
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) <= 6 and max(map(len, cells)) <= 24, row
