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
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.fused_norm import triton_unavailable

pytest.importorskip("transformers")
from test_qwen2_vl_streams import TOLERANCE, call, entries, model

GRIDS = ([(1, 4, 6), (1, 2, 2)], [(2, 4, 4), (1, 8, 8)])
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
    inputs = [call(entries(kind, grids)) for grids in GRIDS]
    with torch.inference_mode():
        want = [tower(p, grid_thw=g).pooler_output for p, g in inputs]
    graphed = layergraph.wrap(
        tower,
        adapter="qwen2_vl",
        backend=SimulatedGraphs(),
        observe_calls=0,
        fuse_norm=False,
        align_mlp=False,
        fuse_gate=True,
        budget_step=32,
    )
    assert sum("fuse_gate" in line for line in graphed.changes) == 2 * len(tower.blocks)
    with torch.inference_mode():
        for (pixels, grid), expected in zip(inputs, want):
            got = graphed(pixels, grid_thw=grid).pooler_output
            assert relative_error(got, expected) <= TOLERANCE
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
