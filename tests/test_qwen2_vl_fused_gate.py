"""fuse_gate in the qwen2_vl adapter, on the CPU through Triton's interpreter: the gated MLPs
of Qwen2.5-VL (hidden width padded) and GLM-4.1V compute gate and up in one product and
``silu(gate) * up`` in one kernel, against the unmodified tower; towers without a gated SiLU
MLP refuse it, saying why.

Answers (simulated graphs, float32, several images and a video) are held to the qwen2_vl
tests' 1e-4 relative error against the tower's own output computed before wrapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import layergraph
from layergraph.kernels import gated
from layergraph_adapters.kit import automatic
from layergraph_adapters.kit.triton_kernels import triton_unavailable

pytest.importorskip("transformers")
from test_qwen2_vl_streams import check_answers, model, option_calls, wrapped_with

needs_the_kernel = pytest.mark.skipif(
    triton_unavailable("fuse_gate", torch.device("cpu")) is not None,
    reason="runs the kernel on CPU tensors, through Triton's interpreter",
)


@pytest.mark.slow
@needs_the_kernel
@pytest.mark.parametrize("kind", ["qwen2_5_vl", "glm4v"])
def test_gated_mlps_answer_as_the_tower(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[tuple[int, ...]] = []
    launch = gated.silu_and_mul

    def counted(gate: torch.Tensor, up: torch.Tensor) -> Any:
        launches.append(tuple(gate.shape))
        return launch(gate, up)

    monkeypatch.setattr(gated, "silu_and_mul", counted)
    tower = model(kind)
    inputs, want = option_calls(kind)
    graphed = wrapped_with(kind, fuse_norm=False, align_mlp=False, fuse_gate=True)
    assert sum("fuse_gate" in line for line in graphed.changes) == 2 * len(tower.blocks)
    check_answers(graphed, inputs, want)
    assert len(launches) >= len(tower.blocks)
    assert graphed.stats.replays == 2
    graphed.unwrap()
    with torch.inference_mode():
        again = tower(*inputs[0][:1], grid_thw=inputs[0][1]).pooler_output
    torch.testing.assert_close(again, want[0])


@needs_the_kernel
def test_a_tower_without_a_gated_mlp_refuses_it() -> None:
    with pytest.raises(ValueError, match="fuse_gate needs a gated MLP"):
        layergraph.wrap(model("qwen3_vl"), adapter="qwen2_vl", fuse_gate=True, fuse_gelu=False)


def test_off_the_gpu_without_the_interpreter_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fuse_gate runs a Triton kernel, which needs a CUDA"):
        layergraph.wrap(model("qwen2_5_vl"), adapter="qwen2_vl", fuse_gate=True)


@needs_the_kernel
@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        ("qwen2_5_vl", "on"),
        ("glm4v", "on"),
        ("qwen2_vl", "off: fuse_gate needs a gated MLP"),
        ("qwen3_vl", "off: fuse_gate needs a gated MLP"),
    ],
)
def test_left_to_auto_the_gated_towers_take_it_on_a_gpu(
    kind: str, outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)
    graphed = wrapped_with(kind, fuse_norm=False, fuse_rotary=False)
    assert graphed.speed_options["fuse_gate"].startswith(outcome)
    assert any("fuse_gate" in line for line in graphed.changes) == (outcome == "on")
    graphed.unwrap()
