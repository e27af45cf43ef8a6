"""Long videos on the Qwen towers under a token cap: a video above every budget is cut into
entries of as many frames as fit (attention never crosses a frame, positions repeat per frame)
and served from graphs, with the answer of the uncut video; the cap (``max_tokens``) bounds
the largest graph, and so the graphs' memory."""

from __future__ import annotations

import pytest
import torch
from test_qwen2_vl_streams import answer, call, model

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")

TOLERANCE = 1e-4
FRAMES = 300
"""Frames of the long video: 150 temporal patches of two frames."""


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "qwen2_vl", "glm_ocr"])
def test_a_long_video_is_served_in_frame_chunks_under_the_cap(kind: str) -> None:
    tower = model(kind)
    video = [(FRAMES // 2, 4, 4), (1, 4, 6)]  # 2,400 patches of video, and an image after it
    pixels, grid = call(video)
    with torch.inference_mode():
        want = answer(tower(pixels, grid_thw=grid))
        graphed = layergraph.wrap(
            tower,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            observe_calls=0,
            max_tokens=256,
            budget_step=32,
        )
        got = answer(graphed(pixels, grid_thw=grid))
        again = answer(graphed(pixels, grid_thw=grid))
    assert len(got) == len(want)
    for part, expected, repeated in zip(got, want, again, strict=True):
        assert relative_error(part, expected) <= TOLERANCE
        assert relative_error(repeated, expected) <= TOLERANCE
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.split_calls == 2 and stats.replays >= 2 * 3, "at least three chunks a call"
    assert max(key.batch for key in graphed.keys) <= 256, "no graph above the cap"
    graphed.unwrap()


def test_a_frame_above_the_cap_still_runs_eagerly_with_the_reason() -> None:
    tower = model("qwen2_5_vl")
    pixels, grid = call([(4, 8, 8)])  # 64 patches a frame, above a cap of 32
    with torch.inference_mode():
        want = answer(tower(pixels, grid_thw=grid))
        graphed = layergraph.wrap(
            tower,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            observe_calls=0,
            max_tokens=32,
            budget_step=16,
        )
        got = answer(graphed(pixels, grid_thw=grid))
    for part, expected in zip(got, want, strict=True):
        assert relative_error(part, expected) <= TOLERANCE
    assert graphed.stats.eager_total == 1
    (reason,) = graphed.stats.eager_calls
    assert "above the largest token budget (32)" in reason
    graphed.unwrap()
