"""The plugin's tests, written with layergraph's pytest plugin (``layergraph.testing``)."""

from __future__ import annotations

import pytest
import torch
from layergraph_dinov2 import Dinov2Adapter
from transformers import Dinov2Config, Dinov2Model

import layergraph
from layergraph.testing import SimulatedGraphs, check_adapter


def small_model() -> Dinov2Model:
    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=56,
        patch_size=14,
    )
    return Dinov2Model(config).eval()


def pixels(batch: int) -> tuple[tuple[torch.Tensor], dict]:
    return (torch.randn(batch, 3, 56, 56),), {}


def test_the_plugin_is_installed(layergraph_registry: object) -> None:
    (info,) = [i for i in layergraph.list_adapters() if i.name == "dinov2-example"]
    assert info.ok and info.distribution == "layergraph-dinov2"


def test_graph_and_eager_match_the_model() -> None:
    result = check_adapter(small_model(), "dinov2-example", pixels, batch_sizes=(1, 3))
    assert [key.sequence for key in result.graphed.keys] == [17, 17]


def test_the_adapter_recognizes_dinov2_only() -> None:
    adapter = Dinov2Adapter()
    assert adapter.recognizes(small_model())
    assert not adapter.recognizes(torch.nn.Linear(2, 2))


def test_bad_images_are_refused() -> None:
    graphed = layergraph.wrap(small_model(), adapter="dinov2-example", backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=r"\[batch, 3, height, width\]"):
        graphed(torch.randn(1, 1, 56, 56))
    assert graphed.stats.graphs == 0


def test_patch_matmul_is_a_recorded_change_undone_by_unwrap() -> None:
    model = small_model()
    convolution = model.embeddings.patch_embeddings.projection
    result = check_adapter(model, "dinov2-example", pixels, batch_sizes=(2,), patch_matmul=True)
    assert (
        "embeddings.patch_embeddings.projection: patch convolution as one matrix product "
        "(patch_matmul)"
    ) in result.graphed.changes
    assert "forward" in vars(convolution)
    result.graphed.unwrap()
    assert "forward" not in vars(convolution)
