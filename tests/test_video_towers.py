"""Video towers of fixed clips (VideoMAE, ViViT, TimeSformer): keyed by clips, equal to eager
(the coverage and conformance tests check every class), and clips of another frame count or
size refused with the ones the tower takes, nothing captured."""

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
