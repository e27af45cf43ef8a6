"""``benchmarks/packed_towers.py --tiny``: every section runs without a GPU, every method's
answers agree with the tower's (layergraph's eager path too), and the stream reports the
budgets chosen and the packed mode's aims.

Four-layer Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V and Pixtral towers in float32 (those the
installed transformers is served with): layergraph's graphs are simulated on the CPU and the
hand-written graph runs its forward eagerly, so each method's error against the float64
reference is float32 rounding (about 1e-6; 1e-5 allowed), and in the stream each answer of
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
pytest.importorskip("rich")

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
OBSERVING = "observing the traffic before choosing token budgets"
"""Why layergraph served the stream's first calls eagerly."""


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmark script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("packed_towers")


def test_the_tiny_run_measures_every_section_and_its_answers_agree(
    bench: Any, tmp_path: Path
) -> None:
    path = tmp_path / "tiny.json"
    result = bench.main(["--tiny", "--requests", "20", "--seconds", "0.01", "--json", str(path)])
    assert json.loads(path.read_text())["towers"][0]["tower"] == "qwen2.5-vl-tiny"
    names = ["qwen2.5-vl-tiny", "qwen3-vl-tiny", "qwen3.5-tiny", "glm-4.1v-tiny", "pixtral-tiny"]
    served = {tower.name for tower in bench.towers(tiny=True) if tower.served_here()}
    assert [record["tower"] for record in result["towers"]] == [n for n in names if n in served]
    assert result["skipped"].keys() == set(names) - served
    for record in result["towers"]:
        assert [row["size"] for row in record["images"]] == [
            f"{width}x{height}" for width, height in bench.TINY_SIZES
        ]
        for row in record["images"]:
            for method in (
                "eager",
                "layergraph_eager",
                "layergraph_triton",
                "layergraph",
                "hand_graph",
            ):
                assert row[f"{method}_ms"] > 0, (record["tower"], row["size"], method)
                assert row[f"{method}_error"] <= TOLERANCE, (record["tower"], row["size"], method)
            assert row["layergraph_served"], row  # the calls were counted
        assert all(record["image_budgets"].values())
        stream = record["stream"]
        assert stream["requests"] == 20 and stream["entries"] >= 20
        assert stream["eager_s"] > 0 and stream["layergraph_s"] > 0 and stream["hand_graph_s"] > 0
        assert stream["layergraph_error"] <= TOLERANCE
        assert stream["hand_graph_error"] <= TOLERANCE
        assert 1 <= stream["graphs"] == len(stream["budgets"])
        # The first 32 calls (four times max_graphs) run eagerly while the budgets are chosen.
        assert stream["eager_calls"] == {OBSERVING: 32}
        assert stream["largest_budget_pool_mib"] is not None
        assert set(stream["budgets"]) <= set(stream["budgets_chosen"])
        assert len(stream["budgets_chosen"]) <= 8 and stream["replans"] >= 1
        assert stream["targets"]["graphs"] == {"value": stream["graphs"], "aim": 8, "met": True}
        assert set(stream["targets"]) == {"graphs", "pool_vs_largest", "capture_s", "vs_hand"}


def test_the_full_size_towers_ask_for_a_gpu_without_one(bench: Any, capsys: Any) -> None:
    if bench.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "need a CUDA GPU; --tiny runs anywhere" in capsys.readouterr().err


def test_the_stream_is_seeded_and_mixes_sizes_counts_and_videos(bench: Any) -> None:
    config = bench.towers(tiny=False)[0].config()
    requests = bench.qwen_towers.stream_requests(config, 100, bench.SIZES, seed=0)
    assert requests == bench.qwen_towers.stream_requests(config, 100, bench.SIZES, seed=0)
    entries = [entry for request in requests for entry in request]
    assert {len(request) for request in requests} == {1, 2, 3}
    assert {entry for entry in entries if entry[0] == 1} == {
        (1, 16, 16),
        (1, 32, 32),
        (1, 32, 48),
        (1, 64, 64),
        (1, 72, 96),
    }
    assert 5 <= sum(entry[0] > 1 for entry in entries) <= 40


def test_glm_4_1v_9b_is_its_configurations_defaults_and_gets_videos_as_frames(bench: Any) -> None:
    glm = bench.towers(tiny=False)[3]
    config = glm.config()
    assert glm.name == "glm-4.1v-9b" and glm.video_rows
    assert (config.depth, config.hidden_size, config.num_heads) == (24, 1536, 12)
    assert (config.patch_size, config.spatial_merge_size, config.out_hidden_size) == (14, 2, 4096)
    assert bench.frame_rows([(2, 4, 6), (1, 2, 2)]) == [(1, 4, 6), (1, 4, 6), (1, 2, 2)]


def test_a_tower_the_installed_transformers_is_not_served_with_is_skipped_by_name(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAYERGRAPH_UNCHECKED_TRANSFORMERS", raising=False)
    monkeypatch.setattr(bench.transformers, "__version__", "5.16.1")
    result = bench.main(["--tiny", "--towers", "glm-4.1v-tiny", "--requests", "1"])
    assert result["towers"] == []
    assert result["skipped"] == {"glm-4.1v-tiny": ">=5.17.0,<5.25"}


def test_pixtrals_stream_holds_images_scaled_to_fit_its_largest_side(bench: Any) -> None:
    config = bench.pixtral_towers.towers(tiny=False)[0].config()
    requests = bench.pixtral_towers.stream_requests(config, 100, bench.SIZES, seed=0)
    assert {len(request) for request in requests} == {1, 2, 3}
    assert {entry for request in requests for entry in request} == {
        (1, 14, 14),
        (1, 28, 28),
        (1, 28, 42),  # 672 wide, 448 high
        (1, 56, 56),
        (1, 48, 64),  # 1344x1008 scaled to 1024x768
    }
