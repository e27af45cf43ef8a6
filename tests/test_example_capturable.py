"""A hand-written graph of an example tower's own forward: what its example's ``capturable``
changes lets a CUDA stream capture, checked on the CPU by the strict simulated capture (what a
stream capture refuses raises). Idefics' own position ids index by a boolean mask up to
transformers 5.17 (a capture refuses them there) and use ``torch.where`` in later releases;
inside ``capturable`` they capture on every release."""

from __future__ import annotations

import pytest
import torch

from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")
from tiny_models import TOWERS, images

from layergraph_adapters.example_models.towers import tower_example


def capture(model: torch.nn.Module, pixels: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    backend = SimulatedGraphs(strict=True)
    graph, output = backend.capture(
        lambda: model(pixels, **inputs), backend.new_pool(), warmup_runs=1
    )
    backend.replay(graph)
    return output.last_hidden_state


@pytest.mark.parametrize(
    ("example", "tower"),
    [
        ("idefics3-8b-364", "Idefics3VisionTransformer"),
        ("smolvlm2-2.2b-384", "SmolVLMVisionTransformer"),
        ("idefics2-8b-980", "Idefics2VisionTransformer"),
    ],
)
def test_an_idefics_tower_captures_inside_its_examples_capturable(example: str, tower: str) -> None:
    model = TOWERS[tower].build()
    pixels = images(2)
    side = pixels.shape[-1] // model.config.patch_size
    # What the VLM passes; without it the tower makes one on the host, which a capture refuses.
    mask = torch.ones(2, side, side, dtype=torch.bool)
    capturable = tower_example(example).capturable
    assert capturable is not None
    with torch.inference_mode():
        want = model(pixels).last_hidden_state
        with capturable(model):
            got = capture(model, pixels, patch_attention_mask=mask)
        assert relative_error(got, want) <= 1e-5
        assert torch.equal(model(pixels).last_hidden_state, want)  # undone on leaving


def test_a_tower_that_captures_as_it_is_has_no_changes() -> None:
    model = TOWERS["SiglipVisionModel"].build()
    pixels = images(2)
    capturable = tower_example("siglip-so400m-384").capturable
    with torch.inference_mode(), capturable(model):
        want = model(pixels).last_hidden_state
        assert relative_error(capture(model, pixels), want) == 0
