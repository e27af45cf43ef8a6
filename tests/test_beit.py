"""BEiT and Data2Vec-Vision: while wrapped, the relative position bias modules read their
index from a copy on the table's device (their own is built on the host, which a CUDA graph
cannot copy from); the answers are the tower's, and unwrap gives the modules their own back."""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["BeitModel", "Data2VecVisionModel"])
def test_the_index_is_kept_on_the_tables_device_and_given_back(name: str) -> None:
    config = getattr(transformers, name.replace("Model", "Config"))(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        use_relative_position_bias=True,
    )
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    biases = [m for m in model.modules() if hasattr(m, "relative_position_bias_table")]
    assert biases
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        want = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    index = biases[0].generate_relative_position_index
    assert index((4, 4)) is index((4, 4)), "kept once per window size and device"
    assert index((4, 4)).device == biases[0].relative_position_bias_table.device
    assert any("relative position index kept" in change for change in graphed.changes)
    graphed.unwrap()
    assert all("generate_relative_position_index" not in m.__dict__ for m in biases)
