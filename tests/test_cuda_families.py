"""The new tower families on a GPU, with real CUDA graphs: tiny towers and VLMs, masks included.

Marked ``cuda`` and skipped without a GPU. The tiny models of :mod:`tiny_models`, built and fed
on the GPU (CUDA as the default device), in float32 with TF32 off (a padded batch may pick
another convolution or matrix kernel, which in TF32 would differ by more than float32's
rounding). The reference is the unmodified model on the same inputs. Tolerance: float32's
1e-4 relative error. What the CPU tests cannot show is
checked here: masks built from graph inputs under stream capture (Idefics' patch mask,
Mllama's aspect-ratio mask) take no host decision, and a partly padded image still matches.
"""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")

from test_tower_families import NEW_TOWERS, NEW_VLMS  # noqa: E402
from tiny_models import IMAGE, TOWERS, VLMS, images, main_tensor, mllama_tiles  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("float32_without_tf32")]

TOLERANCE = 1e-4


def assert_served_by_graphs(stats: layergraph.GraphStats, calls: int) -> None:
    """What holds on any GPU, whichever way the measured policy chooses to serve a batch
    (pad it up to a larger graph, or split it across smaller ones, each graph kept or dropped
    by its measured cost): every call was answered from graph replays, none eagerly."""
    assert stats.eager_total == 0
    assert stats.replays >= calls


@pytest.mark.parametrize("name", list(NEW_TOWERS))
def test_tower_graphs_equal_eager(name: str) -> None:
    tiny = TOWERS[name]
    with torch.device("cuda"), torch.inference_mode():
        model = tiny.build()
        batches = (1, 3, 4, 6)
        expected = [tiny.answer(model, batch, seed) for seed, batch in enumerate(batches)]
        graphed = layergraph.wrap(
            model, adapter=tiny.adapter, batch_sizes=[1, 4], compile_layers=False
        )
        got = [tiny.answer(graphed, batch, seed) for seed, batch in enumerate(batches)]
    for batch, have, want in zip(batches, got, expected):
        assert relative_error(have, want) <= TOLERANCE, batch
    stats = graphed.stats
    assert_served_by_graphs(stats, len(batches))
    # No graph holds 6 images, so that call is split; 3 has no graph of its own either, so it
    # is padded up to 4 or split too (which, the policy measures on the GPU).
    assert stats.split_calls >= 1 and stats.padded_calls + stats.split_calls >= 2


@pytest.mark.parametrize("name", NEW_VLMS)
def test_vlm_image_features_come_from_graphs(name: str) -> None:
    tiny = VLMS[name]
    with torch.device("cuda"), torch.inference_mode():
        model = tiny.build()
        expected = [tiny.answer(model, batch, batch) for batch in (1, 2)]
        graphed = layergraph.wrap(model, compile_layers=False)
        got = [tiny.answer(graphed, batch, batch) for batch in (1, 2)]
    for have, want in zip(got, expected):
        assert relative_error(have, want) <= TOLERANCE
    assert_served_by_graphs(graphed.stats, 2)


def test_idefics_padded_image_is_masked_inside_the_graph() -> None:
    tiny = VLMS["Idefics3ForConditionalGeneration"]
    with torch.device("cuda"), torch.inference_mode():
        model = tiny.build()
        torch.manual_seed(0)
        pixels = images(3).unsqueeze(0)
        mask = torch.ones(1, 3, IMAGE, IMAGE, dtype=torch.long)
        mask[0, 1, 20:, :] = 0
        pixels[0, 1, :, 20:, :] = 0
        want = model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
        graphed = layergraph.wrap(model, compile_layers=False)
        got = graphed.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
    assert relative_error(main_tensor(got), main_tensor(want)) <= TOLERANCE
    assert_served_by_graphs(graphed.stats, 1)


def test_mllama_empty_tiles_are_masked_inside_the_graph() -> None:
    tiny = TOWERS["MllamaVisionModel"]
    with torch.device("cuda"), torch.inference_mode():
        model = tiny.build()
        torch.manual_seed(0)
        call = mllama_tiles(3)
        want = model(**call).last_hidden_state
        graphed = layergraph.wrap(model, compile_layers=False)
        got = graphed(**call).last_hidden_state
    assert relative_error(got, want) <= TOLERANCE
    assert_served_by_graphs(graphed.stats, 1)
