"""The dense block-mask backend (``sdpa_dense_masked``) in the qwen2_vl adapter, on the CPU:
each kind of attention (frames, and Qwen2.5-VL's windows) gets its own mask, written once per
forward at the first layer that uses it, inside the graph.

The backend is for GPUs (off them ``sdpa_varlen`` computes the same); its availability check is
lifted here so that its masks and the plan's calls to ``prepare`` run through PyTorch's CPU
SDPA. Answers (simulated graphs, float32, several images and a video) are held to the
qwen2_vl tests' 1e-4 relative error against the tower's own output computed before wrapping."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import layergraph
from layergraph.attention.backends import DenseMaskedAttention
from layergraph.testing import SimulatedGraphs
from layergraph_adapters.qwen2_vl import Qwen2VLPlan

pytest.importorskip("transformers")
from test_qwen2_vl_streams import check_answers, model, option_calls, wrapped_with


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_block_masks_answer_as_the_tower(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[int] = []
    prepare = DenseMaskedAttention.prepare

    def counted(self: DenseMaskedAttention, metadata: Any, hidden: torch.Tensor) -> None:
        prepared.append(hidden.shape[0])
        prepare(self, metadata, hidden)

    attended: list[int] = []
    attend = Qwen2VLPlan.attend_packed

    def attend_counted(self: Qwen2VLPlan, module: Any, *args: Any, **kwargs: Any) -> Any:
        attended.append(id(module))
        return attend(self, module, *args, **kwargs)

    monkeypatch.setattr(DenseMaskedAttention, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(DenseMaskedAttention, "prepare", counted)
    monkeypatch.setattr(Qwen2VLPlan, "attend_packed", attend_counted)
    tower = model(kind)
    inputs, want = option_calls(kind)
    graphed = wrapped_with(kind, attention="sdpa_dense_masked")
    check_answers(graphed, inputs, want)
    kinds = 2 if kind == "qwen2_5_vl" else 1  # windows and frames, or frames
    forwards = len(attended) // len(tower.blocks)  # warm-ups, captures and timings
    assert forwards and len(prepared) == kinds * forwards  # one mask per kind per forward
    named = "full: sdpa_dense_masked" + (", windows: sdpa_dense_masked" if kinds == 2 else "")
    assert set(graphed.plan.attention_by_budget.values()) == {named}
    assert graphed.stats.replays == 2
    graphed.unwrap()


def test_auto_leaves_it_out_for_these_towers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DenseMaskedAttention, "unavailable_reason", lambda *a: None)
    graphed = layergraph.wrap(model("qwen3_vl"), adapter="qwen2_vl", backend=SimulatedGraphs())
    assert "sdpa_dense_masked" not in [b.name for b in graphed.plan._backends]
    graphed.unwrap()
