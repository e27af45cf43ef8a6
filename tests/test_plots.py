"""``benchmarks/plots.py``: the packed towers' runs as PNGs, from their JSON, on any machine."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def plots(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("plots")


def call(tokens: int, eager: float, hand: float, layergraph: float) -> dict[str, Any]:
    return {"tokens": tokens, "eager_ms": eager, "hand_graph_ms": hand, "layergraph_ms": layergraph}


PACKED = {
    "towers": [
        {
            "tower": "qwen-like",
            "images": [call(1024, 50.0, 10.0, 7.0), call(256, 30.0, 6.0, 4.0)],
            "stream": {
                "eager_s": 13.0,
                "layergraph_first_pass_s": 9.0,
                "layergraph_s": 3.5,
                "hand_graph_s": 4.3,
            },
        },
        {"tower": "no-hand-graph", "images": [{"tokens": 4, "eager_ms": 1.0}]},
    ]
}
NAFLEX = {
    "tower": "siglip2-like",
    "calls": [call(256, 8.0, 2.4, 2.3), call(1008, 9.0, 4.1, 4.0)],
    "stream": None,
}


def test_runs_become_a_calls_and_a_streams_png(plots: Any, tmp_path: Path) -> None:
    packed, naflex = tmp_path / "packed.json", tmp_path / "naflex.json"
    packed.write_text(json.dumps(PACKED))
    naflex.write_text(json.dumps(NAFLEX))
    written = plots.main([str(packed), str(naflex), "--out", str(tmp_path / "run")])
    assert [path.name for path in written] == ["run-calls.png", "run-streams.png"]
    for path in written:
        assert path.read_bytes()[:8] == PNG


def test_rows_are_those_every_method_timed_by_tokens_and_streams_by_method(plots: Any) -> None:
    towers = [tower for run in (PACKED, NAFLEX) for tower in plots.towers_of(run)]
    assert [tower["tower"] for tower in towers] == ["qwen-like", "no-hand-graph", "siglip2-like"]
    assert [row["tokens"] for row in plots.calls_of(towers[0])] == [256, 1024]
    assert plots.calls_of(towers[1]) == []
    assert plots.streams_of(towers[0]) == {
        "eager": 13.0,
        "layergraph, first pass": 9.0,
        "layergraph": 3.5,
        "hand-written graphs": 4.3,
    }
    assert plots.streams_of(towers[2]) == {}


def test_runs_without_timed_calls_are_refused(plots: Any, tmp_path: Path, capsys: Any) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"towers": [{"tower": "x", "images": []}]}))
    with pytest.raises(SystemExit):
        plots.main([str(empty), "--out", str(tmp_path / "run")])
    assert "no tower in these runs has calls timed by every method" in capsys.readouterr().err


def legend_clear_of_the_data(figure: Any) -> bool:
    """Whether every legend of ``figure`` lies outside every visible axes' area."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = [*figure.legends, *(a.get_legend() for a in figure.axes if a.get_legend())]
    areas = [axis.get_window_extent(renderer) for axis in figure.axes if axis.get_visible()]
    assert legends, "the figure has no legend"
    return not any(
        legend.get_window_extent(renderer).overlaps(area) for legend in legends for area in areas
    )


def test_every_plots_legend_sits_outside_its_axes(plots: Any) -> None:
    import matplotlib.pyplot as plt

    from layergraph.bench.report import BenchReport, BenchRow

    towers = [PACKED["towers"][0], {**NAFLEX, "images": NAFLEX["calls"]}]
    report = BenchReport(
        model="vit", adapter="timm", device="GPU", dtype="bfloat16", versions={},
        date="2026-12-06", command="bench", iters=1,
        rows=[BenchRow(b, 2.0 * b, 1.0, 1.0 * b, 1.5 * b, 1.2 * b, 0.9 * b) for b in (1, 8, 32)],
    )  # fmt: skip
    for figure in (plots.calls_figure(towers), plots.streams_figure(towers), report.figure()):
        assert legend_clear_of_the_data(figure)
        plt.close(figure)
