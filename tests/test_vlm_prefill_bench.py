"""``layergraph bench --prefill`` and ``benchmarks/vlm_prefill.py --tiny``: a small Qwen2.5-VL
VLM's time to first token on a stream, eager and wrapped, on the CPU with simulated graphs.

The tiny VLM is float32 and the graphs are simulated, so the wrapped VLM's last logits equal
eager's to float32 rounding (1e-5 allowed). The stream of 12 requests is given twice: the
wrapper observes the first 8 calls, chooses budgets and serves every later call from graphs.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from layergraph.bench.examples import example_model
from layergraph.bench.requests import RequestsReport, draw_requests, run_prefill

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmark script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("vlm_prefill")


def test_the_tiny_stream_is_timed_eager_and_wrapped_and_the_logits_agree(
    bench: Any, tmp_path: Path
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path; a GPU runs the full-size VLM")
    path = tmp_path / "prefill.json"
    result = bench.main(["--tiny", "--json", str(path)])
    assert json.loads(path.read_text())["requests"] == result["requests"] == 12
    assert result["images"] >= 12 and result["prompt_tokens"] > 12 * 32
    assert result["graphs_kind"] == "simulated" and result["dtype"] == "float32"
    for name in ("eager", "layergraph_first_pass", "layergraph"):
        part = result["passes"][name]
        assert 0 < part["p50_ms"] <= part["p90_ms"], name
        assert part["total_s"] > 0 and part["error"] <= 1e-5, name
    assert result["eager_calls"] == {"observing the traffic before choosing token budgets": 8}
    assert result["graphs"] == len(result["budgets"]) >= 1
    assert result["p50_speedup"] > 0 and result["p90_speedup"] > 0


def test_prompts_lay_out_one_image_token_per_merged_patch(bench: Any) -> None:
    example = bench.tiny_vlm()
    config = transformers.Qwen2_5_VLConfig(**bench.TINY_VLM.example.settings)
    for images in draw_requests([1, 2, 3, 2, 1], bench.TINY_SIZES, seed=3):
        prompt = example.prompt(images, torch.float32, CPU)
        ids = prompt["input_ids"][0].tolist()
        grids = prompt["image_grid_thw"].tolist()
        assert [(h * 14, w * 14) for _, h, w in grids] == list(images)  # multiples of 28 kept
        merged = sum(t * h * w for t, h, w in grids) // 4  # spatial merge 2
        assert ids.count(config.image_token_id) == merged
        starts = ids.count(config.vision_start_token_id)
        assert starts == ids.count(config.vision_end_token_id) == len(grids)
        assert len(ids) == 32 + merged + 2 * len(grids)
        assert prompt["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)


def test_requests_are_drawn_reproducibly_of_the_counts_asked() -> None:
    sizes = ((1, 2), (3, 4), (5, 6))
    counts = [1, 3, 2] * 20
    drawn = draw_requests(counts, sizes, seed=7)
    assert drawn == draw_requests(counts, sizes, seed=7) != draw_requests(counts, sizes, seed=8)
    assert [len(images) for images in drawn] == counts
    assert {size for images in drawn for size in images} == set(sizes)


def test_the_report_renders_and_round_trips_as_json(bench: Any, tmp_path: Path) -> None:
    report = run_prefill(
        bench.tiny_vlm(),
        3,
        sizes=bench.TINY_SIZES,
        observe_calls=1,
    )
    assert isinstance(report, RequestsReport) and report.kind == "prefill"
    assert list(report.passes) == [
        "eager",
        "layergraph_first_pass",
        "layergraph",
    ]
    text = report.to_markdown()
    assert "| layergraph | " in text and "Time to first token, eager over layergraph" in text
    report.write_json(tmp_path / "p.json")
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["passes"]["layergraph"]["p50_ms"] == report.passes["layergraph"].p50_ms
    assert record["p50_speedup"] == pytest.approx(report.speedup("p50_ms"))


def test_a_model_without_prompts_is_refused() -> None:
    with pytest.raises(ValueError, match="vit_base_patch16_224 is no VLM with example prompts"):
        run_prefill("vit_base_patch16_224", 1)
    assert example_model("qwen2.5-vl-3b").prompt is not None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--prefill", "2", "--model", "vit_base_patch16_224"], "is no VLM with example prompts"),
        (["--prefill", "2", "--fuse-qkv"], "drop the tuning flags"),
        (["--prefill", "2", "--image-size", "448"], "drop --image-size"),
        (["--prefill", "0"], "expected a whole number of at least 1"),
    ],
)
def test_the_command_names_what_a_prefill_cannot_take(arguments: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "bench", *arguments],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and message in run.stderr


def test_the_full_size_vlm_asks_for_a_gpu_without_one(bench: Any, capsys: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "needs a CUDA GPU; --tiny runs anywhere" in capsys.readouterr().err


@pytest.mark.cuda
def test_the_full_size_prefill_runs_graphed_on_a_gpu(tmp_path: Path) -> None:
    report = run_prefill("qwen2.5-vl-3b", 8, observe_calls=2)
    assert report.graphs_kind == "cuda" and report.graphs >= 1
    assert report.passes["layergraph"].error < 0.15  # bf16 logits: 5.8e-2 measured
    assert report.speedup("p50_ms") is not None
