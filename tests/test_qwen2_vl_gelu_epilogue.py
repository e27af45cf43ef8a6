"""fuse_gelu in the qwen2_vl adapter on the CPU: left to ``"auto"`` on a GPU (the GPU check
replaced), it takes the towers whose MLP is ``fc2(gelu_tanh(fc1(x)))`` (Qwen3-VL's,
Qwen3-VL-MoE's, Qwen3.5's) and leaves the others' with the reason (Qwen2-VL's QuickGELU,
the gated SiLU MLPs of Qwen2.5-VL and GLM, which ``align_mlp`` pads instead).

Answers (simulated graphs, float32) are held to the qwen2_vl tests' 1e-4 relative error
against the tower's own output computed before wrapping, on fresh images and a video: off the
GPU the epilogue's tanh GELU follows an unfused product, the towers' own function."""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit import automatic

pytest.importorskip("transformers")
from test_qwen2_vl_streams import TOLERANCE, call, entries, model

TAKEN = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"]
LEFT = {
    "qwen2_vl": "fuses GELU only",
    "qwen2_5_vl": "needs an MLP of the form fc2(gelu(fc1(x)))",
    "glm4v": "needs an MLP of the form fc2(gelu(fc1(x)))",
}
GRIDS = ([(1, 4, 6), (1, 2, 2)], [(2, 4, 4), (1, 8, 8)])


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)


def wrapped(kind: str) -> tuple[torch.nn.Module, layergraph.GraphedModule]:
    tower = model(kind)
    graphed = layergraph.wrap(
        tower,
        adapter="qwen2_vl",
        backend=SimulatedGraphs(),
        observe_calls=0,
        fuse_norm=False,
        budget_step=32,
    )
    return tower, graphed


@pytest.mark.parametrize("kind", TAKEN)
def test_tanh_gelu_towers_take_the_epilogue_and_answer_as_before(kind: str) -> None:
    reference = model(kind)
    inputs = [call(entries(kind, grids)) for grids in GRIDS]
    with torch.inference_mode():
        want = [reference(p, grid_thw=g).pooler_output for p, g in inputs]
    tower, graphed = wrapped(kind)
    assert graphed.speed_options["fuse_gelu"] == "on"
    assert sum("fuse_gelu" in line for line in graphed.changes) == len(tower.blocks)
    with torch.inference_mode():
        for (pixels, grid), expected in zip(inputs, want):
            got = graphed(pixels, grid_thw=grid).pooler_output
            assert relative_error(got, expected) <= TOLERANCE
    assert graphed.stats.replays == 2
    graphed.unwrap()
    assert all("forward" not in vars(block.mlp) for block in tower.blocks)


@pytest.mark.parametrize("kind", list(LEFT))
def test_other_mlps_keep_their_activation_with_the_reason(kind: str) -> None:
    _, graphed = wrapped(kind)
    assert graphed.speed_options["fuse_gelu"].startswith("off: ")
    assert LEFT[kind] in graphed.speed_options["fuse_gelu"]
    assert not any("fuse_gelu" in line for line in graphed.changes)
    graphed.unwrap()
