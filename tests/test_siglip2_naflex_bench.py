"""``benchmarks/siglip2_naflex.py --tiny``: every section runs without a GPU, for every tower
(SigLIP2 so400m's kind and LFM2-VL's, given LFM2-VL's image processor's tiles), and every
method's answers agree with the tower's.

A four-layer SigLIP2 NaFlex tower in float32: layergraph's graphs are simulated on the CPU and
the hand-written graph runs the forward eagerly, so each method's error against the float64
reference is float32 rounding (about 1e-7; 1e-5 allowed), and in the stream each answer of
layergraph and of the hand-written graphs equals eager's within 1e-5. The stream has 20
requests, given twice (the first pass and the second): layergraph observes the first 32 calls
before choosing budgets.

The hand-written graphs are simulated on the CPU by captures that refuse a tensor read on the
host, as a CUDA graph capture does: the tower's own forward reads its grids on the host with
transformers up to 5.23 (``resize_positional_embeddings``), and not from 5.24, and the
hand-written graph, which resizes the position table outside the graph exactly where the
forward reads the host, captures with either and answers as eager for new grids at its shape.
"""

from __future__ import annotations

import importlib
import json
import random
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
        for column in ("layergraph", "layergraph_triton"):
            assert row[f"{column}_vs_hand"] > 0, row
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


def test_attention_settings_are_columns_and_the_stream_can_be_left_out(bench: Any) -> None:
    result = bench.main(
        ["--tiny", "--seconds", "0.01", "--attention", "auto,sdpa_varlen", "--no-stream"]
    )
    assert result["stream"] is None
    for row in result["calls"]:
        for column in ("layergraph", "layergraph_sdpa_varlen"):
            assert row[f"{column}_error"] <= TOLERANCE, (row, column)
            assert row[f"{column}_budget"] >= row["tokens"], (row, column)
        assert row["layergraph_sdpa_varlen_attention"] == "sdpa_varlen"
        assert "layergraph_triton_ms" not in row


def test_the_so400m_tower_asks_for_a_gpu_without_one(bench: Any, capsys: Any) -> None:
    if bench.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.main([])
    message = "the siglip2-so400m tower needs a CUDA GPU; --tiny runs anywhere"
    assert message in capsys.readouterr().err


def tiny_tower(bench: Any) -> tuple[Any, Any]:
    """The tiny SigLIP2 so400m-like tower on the CPU in float32, and its settings."""
    settings = bench.Settings(
        device=bench.torch.device("cpu"),
        dtype=bench.torch.float32,
        seconds=0.01,
        requests=1,
        seed=0,
        tower=bench.TOWERS["siglip2-so400m"](True),
    )
    return bench.tower_model(settings), settings


def test_the_tower_reads_its_grids_on_the_host_where_the_hand_graph_resizes_outside(
    bench: Any,
) -> None:
    from layergraph.graphs import GraphCaptureError
    from layergraph.testing import CaptureUnsafeOperation

    model, settings = tiny_tower(bench)
    batch = bench.naflex_call(model, 2, 16, random.Random(0), settings)
    with bench.torch.inference_mode(), bench.host_checks_off():
        if not bench.resizes_on_host():
            bench.simulated_plain_graph(model, **batch)
            return
        with pytest.raises(GraphCaptureError) as refused:
            bench.simulated_plain_graph(model, **batch)
    cause = refused.value.__cause__
    assert isinstance(cause, CaptureUnsafeOperation) and "Tensor.tolist" in str(cause)
    assert "resize_positional_embeddings" in str(refused.value)


def test_the_hand_graph_captures_and_answers_as_eager_for_new_grids_at_its_shape(
    bench: Any,
) -> None:
    model, settings = tiny_tower(bench)
    rng = random.Random(1)
    batches = [bench.naflex_call(model, 4, 16, rng, settings) for _ in range(6)]
    grids = {tuple(map(tuple, batch["spatial_shapes"].tolist())) for batch in batches}
    assert len(grids) > 1
    torch = bench.torch
    with torch.inference_mode():
        by_hand, failure = bench.hand_graph(model, batches[0])
        assert failure is None and by_hand is not None
        for batch in batches[::-1]:
            want = bench.answer(model(**batch), batch)
            got = bench.answer(by_hand(**batch), batch)
            assert all(torch.equal(part, expected) for part, expected in zip(got, want))
