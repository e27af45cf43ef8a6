"""fuse_rotary in the qwen2_vl adapter, on the CPU through Triton's interpreter: every packed
tower's q and k rotated by the fused kernel inside the routed attention, against the
unmodified tower; the families' own rotations probed before they are replaced.

Answers (simulated graphs, float32, several images and a video) are held to the qwen2_vl
tests' 1e-4 relative error against the tower's own output computed before wrapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import layergraph
from layergraph_adapters.kit import automatic, fused_rotary
from layergraph_adapters.kit.fused_rotary import FusedRotary, rotates_halves
from layergraph_adapters.kit.triton_kernels import triton_unavailable

pytest.importorskip("transformers")
from test_qwen2_vl_streams import SMALL_GRIDS, check_answers, model, option_calls, wrapped_with

KINDS = ["qwen2_5_vl", "qwen3_vl", "glm_ocr"]
"""One tower of each rotation path: windowed layers (Qwen2.5-VL), interpolated positions
(Qwen3-VL), q and k normalised before the rotation (GLM-OCR), each on small calls
(:data:`~test_qwen2_vl_streams.SMALL_GRIDS`): Triton's interpreter runs one program per
token."""
needs_the_kernel = pytest.mark.skipif(
    triton_unavailable("fuse_rotary", torch.device("cpu")) is not None,
    reason="runs the kernel on CPU tensors, through Triton's interpreter",
)


@pytest.mark.slow
@needs_the_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_fused_rotation_answers_as_the_tower(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[int] = []
    kernel = fused_rotary.FusedRotary.__call__

    def counted(self: FusedRotary, *args: Any) -> Any:
        launches.append(int(self._fits(*args[:3])))
        return kernel(self, *args)

    monkeypatch.setattr(fused_rotary.FusedRotary, "__call__", counted)
    inputs, want = option_calls(kind, SMALL_GRIDS)
    graphed = wrapped_with(kind, fuse_norm=False, fuse_rotary=True, budget_step=16)
    routed = [line for line in graphed.changes if "fuse_rotary" in line]
    assert len(routed) == len(model(kind).blocks)
    check_answers(graphed, inputs, want)
    assert launches and all(launches)  # every rotation went through the kernel
    assert graphed.stats.replays == 2
    graphed.unwrap()


def test_off_the_gpu_without_the_interpreter_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fuse_rotary runs a Triton kernel, which needs a CUDA"):
        layergraph.wrap(model("qwen3_vl"), adapter="qwen2_vl", fuse_rotary=True)


def test_only_the_rotate_half_rotation_is_taken() -> None:
    def interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        def turn(x: torch.Tensor) -> torch.Tensor:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

        return q * cos[:, None] + turn(q) * sin[:, None], k * cos[:, None] + turn(k) * sin[:, None]

    transformers = pytest.importorskip("transformers")
    own = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.apply_rotary_pos_emb_vision
    assert rotates_halves(own)
    assert not rotates_halves(interleaved)
    with pytest.raises(ValueError, match="computes another"):
        FusedRotary(interleaved, torch.device("cuda"))
    with pytest.raises(ValueError, match="fuse_rotary='yes': choose True, False or 'auto'"):
        layergraph.wrap(model("qwen3_vl"), adapter="qwen2_vl", fuse_rotary="yes")


@needs_the_kernel
@pytest.mark.parametrize("kind", ["qwen2_vl", *KINDS, "glm4v", "qwen3_5"])
def test_left_to_auto_every_family_takes_it_on_a_gpu(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)
    graphed = wrapped_with(kind, fuse_norm=False)
    assert graphed.speed_options["fuse_rotary"] == "on"
    assert sum("fuse_rotary" in line for line in graphed.changes) == len(model(kind).blocks)
    graphed.unwrap()


def test_left_to_auto_it_stays_off_on_the_cpu_with_the_reason() -> None:
    graphed = wrapped_with("qwen2_5_vl")
    assert graphed.speed_options["fuse_rotary"] == "off: the model is on cpu, not a CUDA device"
    assert not any("fuse_rotary" in line for line in graphed.changes)
    graphed.unwrap()
