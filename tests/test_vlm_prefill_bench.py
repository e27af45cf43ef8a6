"""``benchmarks/vlm_prefill.py --tiny``: a small Qwen2.5-VL VLM's time to first token on a
stream, eager and wrapped, on the CPU with simulated graphs.

The tiny VLM is float32 and the graphs are simulated, so the wrapped VLM's last logits equal
eager's to float32 rounding (1e-5 allowed). The stream of 12 requests is given twice: the
wrapper observes the first 8 calls, chooses budgets and serves every later call from graphs.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmark script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("vlm_prefill")


def test_the_tiny_stream_is_timed_eager_and_wrapped_and_the_logits_agree(
    bench: Any, tmp_path: Path
) -> None:
    if bench.torch.cuda.is_available():
        pytest.skip("checks the CPU path; a GPU runs the full-size VLM")
    path = tmp_path / "prefill.json"
    result = bench.main(["--tiny", "--json", str(path)])
    assert json.loads(path.read_text())["requests"] == result["requests"] == 12
    assert result["images"] >= 12 and result["vision_tokens"] > 0
    for name in ("eager", "layergraph_first_pass", "layergraph"):
        part = result[name]
        assert 0 < part["p50_ms"] <= part["p90_ms"], name
        assert part["total_s"] > 0 and part["error"] <= 1e-5, name
    assert result["eager_calls"] == {"observing the traffic before choosing token budgets": 8}
    assert result["graphs"] == len(result["budgets"]) >= 1
    assert result["p50_speedup"] > 0 and result["p90_speedup"] > 0


def test_requests_lay_out_one_image_token_per_merged_patch(bench: Any) -> None:
    settings = bench.Settings(
        device=bench.torch.device("cpu"),
        dtype=bench.torch.float32,
        requests=1,
        seed=0,
        sizes=bench.TINY_SIZES,
    )
    model = bench.build(True, settings)
    rng = bench.random.Random(3)
    for _ in range(5):
        inputs = bench.request(model, rng, settings)
        ids = inputs["input_ids"][0].tolist()
        grids = inputs["image_grid_thw"].tolist()
        merged = sum(t * h * w for t, h, w in grids) // 4  # spatial merge 2
        assert ids.count(bench.IMAGE) == merged
        assert ids.count(bench.START) == ids.count(bench.END) == len(grids)
        assert len(ids) == bench.PROMPT_TOKENS + merged + 2 * len(grids)
        assert inputs["pixel_values"].shape[0] == sum(t * h * w for t, h, w in grids)


def test_the_full_size_vlm_asks_for_a_gpu_without_one(bench: Any, capsys: Any) -> None:
    if bench.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "needs a CUDA GPU; --tiny runs anywhere" in capsys.readouterr().err
