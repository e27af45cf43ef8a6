"""Video towers of fixed clips (VideoMAE, ViViT, TimeSformer): keyed by clips, equal to eager
(the coverage and conformance tests check every class), clips of another frame count or size
refused with the ones the tower takes, nothing captured; the tensors VideoMAE and SAM keep or
make on the host put on the device while wrapped."""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs

transformers = pytest.importorskip("transformers")


def videomae() -> torch.nn.Module:
    config = transformers.VideoMAEConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        num_frames=4,
    )
    torch.manual_seed(0)
    return transformers.VideoMAEForVideoClassification(config).eval()


def test_a_video_classifier_reads_its_tower_from_the_graphs_keyed_by_clips() -> None:
    model = videomae()
    clips = torch.randn(3, 4, 3, 32, 32)
    with torch.inference_mode():
        want = model(pixel_values=clips).logits
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed(pixel_values=clips).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert graphed.adapter.name == "video"
    assert [str(key.sequence) for key in graphed.keys] == ["32 tokens (4 frames of 32x32)"]
    graphed.unwrap()


def test_clips_of_another_frame_count_or_size_are_refused_naming_what_it_takes() -> None:
    tower = videomae().videomae
    graphed = layergraph.wrap(tower, backend=SimulatedGraphs())
    with torch.inference_mode():
        with pytest.raises(ValueError, match="clips of 4 frames of 3 channels at 32x32, got 8"):
            graphed(pixel_values=torch.randn(1, 8, 3, 32, 32))
        with pytest.raises(ValueError, match=r"\[clips, frames, channels, height, width\]"):
            graphed(pixel_values=torch.randn(1, 3, 32, 32))
    assert graphed.keys == [] and graphed.stats.captures == 0


def test_a_plain_tensor_attribute_moves_with_the_model_while_wrapped() -> None:
    model = videomae()
    embeddings = model.videomae.embeddings
    table = embeddings.position_embeddings
    keys = set(model.state_dict())
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert "position_embeddings" in embeddings._buffers, "a buffer moves with model.to()"
    assert torch.equal(embeddings.position_embeddings, table)
    assert set(model.state_dict()) == keys, "non-persistent: the state dict is the model's"
    graphed.unwrap()
    assert "position_embeddings" not in embeddings._buffers
    assert embeddings.position_embeddings is table


def test_sams_relative_positions_are_gathered_on_the_device_while_wrapped() -> None:
    config = transformers.SamVisionConfig(
        hidden_size=32,
        output_channels=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        window_size=2,
        global_attn_indexes=[1],
        mlp_dim=64,
    )
    torch.manual_seed(0)
    model = transformers.SamVisionModel(config).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        want = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    attentions = [m for m in model.modules() if hasattr(m, "use_rel_pos")]
    assert attentions and all("get_rel_pos" in m.__dict__ for m in attentions)
    graphed.unwrap()
    assert all("get_rel_pos" not in m.__dict__ for m in attentions)
