"""positions_matmul on the CPU: GLM-4.1V's learned position table resampled to each patch as
one matrix product of bicubic weights, against ``F.grid_sample`` (bicubic, border padding,
corners not aligned) on random tables and points inside, on and past the edges; then in the
qwen2_vl adapter, the GLM-4.1V tower with it against the unmodified tower (simulated graphs,
float32, 1e-4 relative error, several images and a video), undone by unwrap(); towers
without such a table refuse it, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from layergraph_adapters.kit import automatic
from layergraph_adapters.kit.position_resampling import ResampledPositions, bicubic_rows

pytest.importorskip("transformers")
from test_qwen2_vl_streams import check_answers, model, option_calls, wrapped_with


@settings(max_examples=30, deadline=None)
@given(side=st.integers(2, 24), points=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_the_product_is_grid_samples_bicubic_resampling(side: int, points: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(side * side, 16, generator=generator)
    x, y = (torch.rand(points, generator=generator) * 2.4 - 1.2 for _ in range(2))
    x[:3] = torch.tensor([-1.0, 1.0, 0.0])[: min(3, points)]
    grid = torch.stack((x, y), -1)[None, :, None, :]
    image = table.view(side, side, 16).permute(2, 0, 1)[None]
    want = F.grid_sample(image, grid, mode="bicubic", padding_mode="border", align_corners=False)[
        0, :, :, 0
    ].T
    torch.testing.assert_close(bicubic_rows(table, x, y), want, rtol=1e-5, atol=1e-5)


def test_the_glm_tower_answers_as_before_and_is_restored() -> None:
    tower = model("glm4v")
    inputs, want = option_calls("glm4v")
    graphed = wrapped_with("glm4v", positions_matmul=True, fuse_norm=False)
    try:
        assert [line for line in graphed.changes if "positions_matmul" in line] == [
            "embeddings: position table resampled as one matrix product (positions_matmul)"
        ]
        check_answers(graphed, inputs, want)
    finally:
        graphed.unwrap()
    assert "forward" not in vars(tower.embeddings)


def test_left_to_auto_only_the_glm_tables_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)
    outcomes = {}
    for kind in ("glm4v", "qwen3_vl"):
        graphed = wrapped_with(
            kind, positions_matmul="auto", fuse_norm=False, fuse_rotary=False, fuse_gate=False
        )
        outcomes[kind] = graphed.speed_options["positions_matmul"]
        graphed.unwrap()
    assert outcomes["glm4v"] == "on"
    assert outcomes["qwen3_vl"].startswith(
        "off: positions_matmul is not available for Qwen3VLVisionModel: it resamples no learned"
    )


def test_other_modules_and_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="Linear has none"):
        ResampledPositions(torch.nn.Linear(2, 2))
    embeddings = model("glm4v").embeddings
    embeddings.interpolated_method = "bilinear"
    try:
        with pytest.raises(ValueError, match="computes bicubic resampling"):
            ResampledPositions(embeddings)
    finally:
        embeddings.interpolated_method = "bicubic"
