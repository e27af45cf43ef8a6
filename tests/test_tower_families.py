"""The fixed-resolution tower families on the CPU: each tower alone and inside its VLM.

Idefics2, Idefics3, SmolVLM, Janus, AIMv2, DINOv2 (with and without registers), ViT, Llama 4
and Mllama, from :mod:`tiny_models`. Graphs are simulated, with costs that make a graph of
its own, a padded one and chunks each win somewhere under the measured policy; every answer is
compared with the unwrapped model's on fresh random inputs. Tolerance: float32, the same
kernels as eager on zero-padded or chunked batches, so 1e-4 relative error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import (  # noqa: E402
    IMAGE,
    TOWERS,
    VLMS,
    images,
    main_tensor,
    mllama_tiles,
)

import layergraph  # noqa: E402
from layergraph.testing import SimulatedGraphs  # noqa: E402
from layergraph.validation import relative_error  # noqa: E402

TOLERANCE = 1e-4
STREAM = (4, 4, 4, 2, 2, 2, 3, 3, 7, 7, 1, 1)
"""Batch sizes in the order they come, each call on fresh images. With two graphs allowed,
4 and 2 get graphs of their own; 3, 7 and 1 (each timed eagerly the first time) are then
served padded to 4, in chunks of 4 and padded to 2."""

NEW_TOWERS = {
    "Idefics2VisionTransformer": "16 tokens (32x32)",
    "Idefics3VisionTransformer": "16 tokens (32x32)",
    "SmolVLMVisionTransformer": "16 tokens (32x32)",
    "JanusVisionModel": "16 tokens (32x32)",
    "Aimv2VisionModel": "16 tokens (32x32)",
    "Dinov2Model": "17 tokens (32x32)",
    "Dinov2WithRegistersModel": "21 tokens (32x32)",
    "ViTModel": "17 tokens (32x32)",
    "Llama4VisionModel": "17 tokens (32x32)",
    "MllamaVisionModel": "1 image(s) x 2 tiles x 17 tokens (32x32)",
}
"""Each new family's tower, and the sequence of its key for 32x32 images of 4x4 patches:
SigLIP-like towers have no class token, DINOv2's registers add four, Mllama keys its tiles."""

NEW_VLMS = (
    "Idefics2ForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "JanusForConditionalGeneration",
    "Llama4ForConditionalGeneration",
    "MllamaForConditionalGeneration",
)


def measured_backend() -> SimulatedGraphs:
    """Eager calls cost 4 ms of launches plus 1 ms a row; replays 1 ms a row."""
    return SimulatedGraphs(eager_ms=lambda rows: 4.0 + rows, replay_ms=lambda rows: float(rows))


@pytest.mark.parametrize("name", list(NEW_TOWERS))
def test_tower_serves_a_stream_as_eager_does(name: str) -> None:
    tiny = TOWERS[name]
    model = tiny.build()
    with torch.inference_mode():
        expected = [tiny.answer(model, batch, seed) for seed, batch in enumerate(STREAM)]
        graphed = layergraph.wrap(
            model, adapter=tiny.adapter, backend=measured_backend(), max_graphs=2
        )
        for seed, (batch, want) in enumerate(zip(STREAM, expected)):
            got = tiny.answer(graphed, batch, seed)
            assert got.shape == want.shape
            assert relative_error(got, want) <= TOLERANCE, batch
    assert graphed.adapter.name == tiny.adapter
    assert graphed.stats.served == {
        (4, "graph"): 3,
        (2, "graph"): 3,
        (3, "eager"): 1,
        (3, "padded to 4"): 1,
        (7, "eager"): 1,
        (7, "chunks 4+4"): 1,
        (1, "eager"): 1,
        (1, "padded to 2"): 1,
    }
    assert {str(key.sequence) for key in graphed.keys} == {NEW_TOWERS[name]}


@pytest.mark.parametrize(
    "name", [n for n in NEW_TOWERS if n not in ("Llama4VisionModel", "MllamaVisionModel")]
)
def test_the_key_counts_the_tokens_the_layers_see(name: str) -> None:
    """The spec's prefix tokens are right: the key's token count is the length of the
    sequence the tower returns (Llama 4 pixel-shuffles it, Mllama joins tiles: not these)."""
    tiny = TOWERS[name]
    graphed = layergraph.wrap(tiny.build(), adapter=tiny.adapter, backend=SimulatedGraphs())
    with torch.inference_mode():
        out = tiny.answer(graphed, 2, seed=0)
    (key,) = graphed.keys
    assert out.shape[1] == key.sequence.tokens


def vlm_answers(tiny: Any, model: torch.nn.Module, batch: int) -> tuple[torch.Tensor, Any]:
    """The image features (or logits) a VLM gives for ``batch`` random images, and the tokens
    its ``generate`` gives for a prompt holding others, or the error transformers' own
    generate raises for this family; the images are drawn from seed ``batch``."""
    features = tiny.answer(model, batch, seed=batch)
    try:
        generated = model.generate(**tiny.prompt(batch), max_new_tokens=3, do_sample=False)
    except AttributeError as error:  # transformers 5.24's Llama 4 forward reads a missing field
        generated = error
    return features, generated


@pytest.mark.parametrize("name", NEW_VLMS)
def test_vlm_reaches_the_graphs_through_its_own_methods(name: str) -> None:
    tiny = VLMS[name]
    model = tiny.build()
    batches = (1, 3, 2)
    with torch.inference_mode():
        expected = [vlm_answers(tiny, model, batch) for batch in batches]
        graphed = layergraph.wrap(model, backend=measured_backend())
        got = [vlm_answers(tiny, graphed, batch) for batch in batches]
    for batch, (features, generated), (want, want_generated) in zip(batches, got, expected):
        assert relative_error(features, want) <= TOLERANCE, batch
        if isinstance(want_generated, Exception):
            assert str(generated) == str(want_generated)  # the same error, not a new one
        else:
            assert torch.equal(generated, want_generated), batch
    stats = graphed.stats
    assert graphed.adapter.name == tiny.adapter
    assert stats.replays >= len(batches) and stats.eager_total == 0
    tower = graphed.plan.owner
    graphed.unwrap()
    assert "forward" not in vars(tower)


def test_idefics_vlm_attends_padded_images_as_eager_does() -> None:
    """An image smaller than the largest in its batch is padded, and the VLM's pixel mask
    masks the padding: the graphs take the patch mask as an input, so they attend as eager."""
    tiny = VLMS["Idefics3ForConditionalGeneration"]
    model = tiny.build()
    torch.manual_seed(0)
    pixels = images(3).unsqueeze(0)
    mask = torch.ones(1, 3, IMAGE, IMAGE, dtype=torch.long)
    mask[0, 1, 20:, :] = 0  # the second image is 20 pixels high: its last patch rows are padding
    pixels[0, 1, :, 20:, :] = 0
    with torch.inference_mode():
        want = model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
        unmasked = graphed.get_image_features(pixel_values=pixels)
    assert relative_error(main_tensor(got), main_tensor(want)) <= 1e-4
    # Without the mask the padded image's features differ: the mask reached the graphs.
    assert relative_error(main_tensor(unmasked), main_tensor(want)) > 1e-3
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0


def test_mllama_empty_tiles_are_masked_in_the_graphs() -> None:
    """A prompt whose image fills one of its two tiles: the aspect-ratio mask, an input of the
    graph, keeps the empty tile out of attention as eager does."""
    tiny = TOWERS["MllamaVisionModel"]
    model = tiny.build()
    torch.manual_seed(0)
    call = mllama_tiles(3)
    with torch.inference_mode():
        want = model(**call).last_hidden_state
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed(**call).last_hidden_state
        call["aspect_ratio_mask"] = torch.ones_like(call["aspect_ratio_mask"])
        unmasked = graphed(**call).last_hidden_state
    assert relative_error(got, want) <= TOLERANCE
    assert relative_error(unmasked[1:], want[1:]) > 1e-3  # the mask reached the graphs
    assert graphed.stats.replays == 2


@pytest.mark.parametrize(
    ("name", "call", "message"),
    [
        (
            "MllamaVisionModel",
            lambda: {**mllama_tiles(1), "pixel_values": torch.randn(1, 1, 3, 3, IMAGE, IMAGE)},
            r"expected 2 tiles per image \(max_num_tiles, empty tiles included\), got 3",
        ),
        (
            "MllamaVisionModel",
            lambda: {**mllama_tiles(1), "pixel_values": torch.randn(1, 3, IMAGE, IMAGE)},
            r"\[batch, images, tiles, channels, height, width\], got \(1, 3, 32, 32\)",
        ),
        (
            "MllamaVisionModel",
            lambda: {**mllama_tiles(2), "aspect_ratio_mask": torch.ones(2, 1, 3)},
            r"expected aspect_ratio_mask of shape \(2, 1, 2\), got \(2, 1, 3\)",
        ),
        (
            "Llama4VisionModel",
            lambda: {"pixel_values": torch.randn(1, 3, 48, 48)},
            r"48x48 differs from the model's 32x32, the only size Llama4VisionModel takes",
        ),
        (
            "JanusVisionModel",
            lambda: {"pixel_values": torch.randn(1, 3, 48, 48)},
            r"pass interpolate_pos_encoding=True",
        ),
    ],
)
def test_inputs_a_tower_cannot_take_are_refused_before_capture(
    name: str, call: Any, message: str
) -> None:
    tiny = TOWERS[name]
    graphed = layergraph.wrap(tiny.build(), adapter=tiny.adapter, backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        graphed(**call())
    assert graphed.stats.graphs == 0


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("Idefics3VisionTransformer", {"fuse_qkv": True, "patch_matmul": True, "fuse_gelu": True}),
        ("Aimv2VisionModel", {"fuse_qkv": True, "patch_matmul": True}),
        ("JanusVisionModel", {"patch_matmul": True, "feature_layers": -2}),
        ("Dinov2WithRegistersModel", {"patch_matmul": True, "feature_layers": [1]}),
        ("ViTModel", {"patch_matmul": True, "feature_layers": -2}),
        ("Llama4VisionModel", {"feature_layers": -2}),
    ],
)
def test_speed_options_and_feature_layers_where_the_family_has_them(
    name: str, options: dict[str, Any]
) -> None:
    tiny = TOWERS[name]
    model = tiny.build()
    hidden = "feature_layers" in options

    def answer(target: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(0)
        if hidden:
            layer = options["feature_layers"]
            out = target(pixel_values=images(3), output_hidden_states=True)
            return out.hidden_states[layer if isinstance(layer, int) else layer[0]]
        return tiny.call(target, 3)

    with torch.inference_mode():
        want = answer(model)
        graphed = layergraph.wrap(model, adapter=tiny.adapter, backend=SimulatedGraphs(), **options)
        got = answer(graphed)
    assert relative_error(got, want) <= TOLERANCE
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0
    graphed.unwrap()
    with torch.inference_mode():
        assert relative_error(answer(model), want) == 0  # unwrapped: the model's own code again


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("JanusVisionModel", {"fuse_qkv": True}, r"fuse_qkv is not available for Janus"),
        ("Llama4VisionModel", {"fuse_qkv": True}, r"fuse_qkv is not available for Llama 4"),
        ("Dinov2Model", {"fuse_qkv": True}, r"fuse_qkv is not available for DINOv2"),
        ("Llama4VisionModel", {"patch_matmul": True}, r"patch_matmul is not available"),
        ("Aimv2VisionModel", {"fuse_gelu": True}, r"fuse_gelu needs an MLP of the form"),
        ("MllamaVisionModel", {"feature_layers": -2}, r"feature_layers is not available"),
    ],
)
def test_options_a_family_cannot_take_are_refused_with_the_reason(
    name: str, options: dict[str, Any], message: str
) -> None:
    tiny = TOWERS[name]
    with pytest.raises((layergraph.AdapterMismatch, ValueError), match=message):
        layergraph.wrap(tiny.build(), adapter=tiny.adapter, backend=SimulatedGraphs(), **options)


def test_vipllava_graphs_stop_at_the_deepest_layer_it_reads() -> None:
    """VipLLaVA reads hidden states 1 and -2 of its 3-layer CLIP tower (its setting was
    ``vision_feature_layers`` before transformers 5.24): the graphs stop after layer 2."""
    tiny = VLMS["VipLlavaForConditionalGeneration"]
    model = tiny.build()
    with torch.inference_mode():
        want = tiny.answer(model, 2, seed=0)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = tiny.answer(graphed, 2, seed=0)
    assert relative_error(got, want) <= TOLERANCE
    assert graphed.plan.feature_layers == (1, 2)
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0


@pytest.mark.parametrize(
    "name", ["Idefics2VisionTransformer", "Idefics3VisionTransformer", "SmolVLMVisionTransformer"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_idefics_position_ids_equal_the_towers_own_without_boolean_indexing(
    name: str, dtype: torch.dtype
) -> None:
    """transformers 5.6's Idefics embeddings write position ids by boolean-mask indexing, which
    a CUDA capture refuses; the plan computes the same embeddings with torch.where, for images
    of every size in a padded batch, in float32 and in bf16 (where 5.6 rounds the coordinates)."""
    from layergraph_adapters.kit.idefics import CapturablePositions

    embeddings = TOWERS[name].build().embeddings.to(dtype)
    per_side = embeddings.num_patches_per_side
    patch = embeddings.patch_size
    mask = torch.zeros(4, per_side, per_side, dtype=torch.bool)
    for row, (height, width) in enumerate([(per_side, per_side), (1, 1), (2, 3), (per_side, 1)]):
        mask[row, :height, :width] = True
    pixels = torch.randn(4, 3, per_side * patch, per_side * patch, dtype=dtype)
    rewrite = CapturablePositions(embeddings)
    with torch.inference_mode():
        want = embeddings(pixels, patch_attention_mask=mask)
        rewrite.apply()
        try:
            got = embeddings(pixels, patch_attention_mask=mask)
        finally:
            rewrite.undo()
    assert "forward" not in vars(embeddings)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", ["Idefics2VisionTransformer", "Idefics3VisionTransformer", "SmolVLMVisionTransformer"]
)
def test_idefics_capture_holds_nothing_a_cuda_capture_refuses(name: str) -> None:
    """A strict simulated capture (what a CUDA stream capture refuses raises) of the whole
    tower, embeddings included, with a patch mask of padded images as a graph input."""
    tiny = TOWERS[name]
    model = tiny.build()
    per_side = model.embeddings.num_patches_per_side
    mask = torch.ones(2, per_side, per_side, dtype=torch.bool)
    mask[1, 1:, :] = False
    pixels = images(2)
    with torch.inference_mode():
        want = model(pixels, patch_attention_mask=mask).last_hidden_state
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(strict=True), batch_sizes=[2])
        got = graphed(pixels, patch_attention_mask=mask).last_hidden_state
    assert relative_error(got, want) <= 1e-4
    assert graphed.stats.captures == 1 and graphed.stats.eager_total == 0
