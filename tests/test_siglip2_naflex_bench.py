"""``benchmarks/siglip2_naflex.py --tiny``: every section runs without a GPU, for every tower
(SigLIP2 so400m's kind and LFM2-VL's, given LFM2-VL's image processor's tiles), and every
method's answers agree with the tower's.

A four-layer SigLIP2 NaFlex tower in float32: layergraph's graphs are simulated on the CPU and
the hand-written graph runs the forward eagerly, so each method's error against the float64
reference is float32 rounding (about 1e-7; 1e-5 allowed), and in the stream each answer of
layergraph and of the hand-written graphs equals eager's within 1e-5. The stream has 20
requests, given twice (the first pass and the second): layergraph observes the first 32 calls
before choosing budgets.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
METHODS = ("eager", "hand_graph", "layergraph", "layergraph_triton")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmark script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("siglip2_naflex")


@pytest.mark.parametrize("tower", ["siglip2-so400m", "lfm2-vl-450m", "lfm2-vl-1.6b"])
def test_the_tiny_run_measures_every_section_and_its_answers_agree(
    bench: Any, tmp_path: Path, tower: str
) -> None:
    path = tmp_path / "tiny.json"
    result = bench.main(
        ["--tiny", "--tower", tower, "--requests", "20", "--seconds", "0.01", "--json", str(path)]
    )
    assert json.loads(path.read_text())["graphs"] == result["graphs"]
    assert result["tower"] == tower
    calls = bench.TOWERS[tower](True).calls
    assert [(row["images"], row["max_patches"]) for row in result["calls"]] == list(calls)
    for row in result["calls"]:
        assert row["encoded_images"] >= row["images"]
        assert 0 < row["tokens"] <= row["encoded_images"] * row["max_patches"]
        for method in METHODS:
            assert row[f"{method}_ms"] > 0, (row, method)
            assert row[f"{method}_error"] <= TOLERANCE, (row, method)
        assert row["layergraph_served"] and row["layergraph_triton_served"], row
    stream = result["stream"]
    assert stream["requests"] == 20 and stream["images"] >= 20
    assert stream["tokens"] < stream["padded_tokens"]
    assert stream["eager_s"] > 0 and stream["layergraph_s"] > 0 and stream["hand_graph_s"] > 0
    for method in ("layergraph_first_pass", "layergraph", "hand_graph"):
        assert stream[f"{method}_error"] <= TOLERANCE, method
    assert 1 <= stream["graphs"] == len(stream["budgets"])
    # The first 32 calls (four times max_graphs) run eagerly while the budgets are chosen.
    assert stream["eager_calls"] == {"observing the traffic before choosing token budgets": 32}
    assert stream["hand_graph_failures"] == []


def test_the_so400m_tower_asks_for_a_gpu_without_one(bench: Any, capsys: Any) -> None:
    if bench.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.main([])
    message = "the siglip2-so400m tower needs a CUDA GPU; --tiny runs anywhere"
    assert message in capsys.readouterr().err
