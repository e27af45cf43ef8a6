"""fuse_norm and fuse_gelu in the siglip2 adapter on the CPU (off by default; left to "auto"
with the GPU check replaced, the add-and-norm kernel through Triton's interpreter): the NaFlex
tower's layers rewritten, every answer within the siglip2 tests' 1e-4 relative error of the
unmodified tower (simulated graphs, float32, mixed grids), the padding zero; on the CPU both
stay off, saying why; unwrap() gives the layers back."""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph_adapters.kit import automatic
from layergraph_adapters.kit.fused_norm import fused_norm_unavailable

transformers = pytest.importorskip("transformers")
from test_siglip2_adapter import check, tower  # noqa: E402


def wrapped(model: object, **options: object) -> layergraph.GraphedModule:
    settings = dict(adapter="siglip2", backend=SimulatedGraphs(), observe_calls=0)
    return layergraph.wrap(model, **{**settings, **options})


@pytest.mark.slow  # the add-and-norm kernel in Triton's interpreter
@pytest.mark.skipif(
    fused_norm_unavailable(torch.device("cpu")) is not None,
    reason="runs the add-and-norm kernel through Triton's interpreter",
)
def test_on_a_gpu_both_options_are_taken_and_the_answers_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)
    model = tower()
    default = wrapped(model)
    assert default.speed_options == {"fuse_norm": "off", "fuse_gelu": "off"}
    default.unwrap()
    graphed = wrapped(model, fuse_norm="auto", fuse_gelu="auto")
    assert graphed.speed_options == {"fuse_norm": "on", "fuse_gelu": "on"}
    layers = len(model.encoder.layers)
    assert sum("fuse_norm" in line for line in graphed.changes) == layers
    assert sum("fuse_gelu" in line for line in graphed.changes) == layers
    for grids in ([(4, 6), (2, 3)], [(5, 5)], [(3, 8), (6, 2), (1, 1)]):
        check(graphed, model, grids)
    assert graphed.stats.replays == 3
    graphed.unwrap()
    assert all("forward" not in vars(layer) for layer in model.encoder.layers)
    assert all("forward" not in vars(layer.mlp) for layer in model.encoder.layers)


def test_on_the_cpu_both_stay_off_with_the_reason() -> None:
    graphed = wrapped(tower(), fuse_norm="auto", fuse_gelu="auto")
    assert graphed.speed_options == {
        "fuse_norm": "off: the model is on cpu, not a CUDA device",
        "fuse_gelu": "off: the model is on cpu, not a CUDA device",
    }
    graphed.unwrap()
