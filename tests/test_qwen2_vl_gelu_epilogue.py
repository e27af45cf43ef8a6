"""fuse_gelu in the qwen2_vl adapter on the CPU: left to ``"auto"`` on a GPU (the GPU check
replaced), it takes the towers whose MLP is ``fc2(gelu_tanh(fc1(x)))`` (Qwen3-VL's,
Qwen3-VL-MoE's, Qwen3.5's) and leaves the others' with the reason (Qwen2-VL's QuickGELU,
the gated SiLU MLPs of Qwen2.5-VL and GLM, which ``align_mlp`` pads instead).

Answers (simulated graphs, float32) are held to the qwen2_vl tests' 1e-4 relative error
against the tower's own output computed before wrapping, on fresh images and a video: off the
GPU the epilogue's tanh GELU follows an unfused product, the towers' own function."""

from __future__ import annotations

import pytest

from layergraph_adapters.kit import automatic

pytest.importorskip("transformers")
from test_qwen2_vl_streams import check_answers, model, option_calls, wrapped_with

TAKEN = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"]
LEFT = {
    "qwen2_vl": "fuses GELU only",
    "qwen2_5_vl": "needs an MLP of the form fc2(gelu(fc1(x)))",
    "glm4v": "needs an MLP of the form fc2(gelu(fc1(x)))",
}


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)


@pytest.mark.parametrize("kind", TAKEN)
def test_tanh_gelu_towers_take_the_epilogue_and_answer_as_before(kind: str) -> None:
    tower = model(kind)
    inputs, want = option_calls(kind)
    graphed = wrapped_with(kind, fuse_norm=False, fuse_rotary=False)
    assert graphed.speed_options["fuse_gelu"] == "on"
    assert sum("fuse_gelu" in line for line in graphed.changes) == len(tower.blocks)
    check_answers(graphed, inputs, want)
    assert graphed.stats.replays == 2
    graphed.unwrap()
    assert all("forward" not in vars(block.mlp) for block in tower.blocks)


@pytest.mark.parametrize("kind", list(LEFT))
def test_other_mlps_keep_their_activation_with_the_reason(kind: str) -> None:
    graphed = wrapped_with(kind, fuse_norm=False)
    assert graphed.speed_options["fuse_gelu"].startswith("off: ")
    assert LEFT[kind] in graphed.speed_options["fuse_gelu"]
    assert not any("fuse_gelu" in line for line in graphed.changes)
    graphed.unwrap()
