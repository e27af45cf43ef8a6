"""LFM2-VL's vision tower on the GPU, served per token budget by the siglip2 adapter.

Marked ``cuda`` and skipped without a GPU. The images are random photos made into LFM2-VL's
inputs by its own image processor (``Lfm2VlImageProcessor``: large photos cut into 512-pixel
tiles with a thumbnail, small ones resized whole, every image padded to 1024 patches), so the
masks and grids are the ones the VLM is given. Two kinds of test:

- ``Lfm2VlForConditionalGeneration`` with the tower of LFM2-VL-450M's width (SigLIP2 base/16
  NaFlex: 12 layers of 768, 12 heads, no pooling head), random weights, bf16, a small text
  model: ``get_image_features`` through the graphs and eagerly, each against a float32 copy
  of the same weights, the graphs' error at most bf16's tolerance (2e-2) or 1.25 times
  eager's own, whichever is larger;
- the tiny LFM2-VL of :mod:`test_siglip2_adapter` in float32 with TF32 off: image features,
  logits and ``generate()`` through the graphs equal to the unwrapped model's (1e-4 relative
  error; the same tokens).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

transformers = pytest.importorskip("transformers")

from test_siglip2_adapter import IMAGE_TOKEN, TEXT, call, lfm2_vl  # noqa: E402

pytestmark = pytest.mark.cuda

TOLERANCE = 1e-4
BASE = dict(
    model_type="siglip2_vision_model",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    patch_size=16,
    num_patches=256,
    vision_use_head=False,
)
"""SigLIP2 base/16 NaFlex's tower as LFM2-VL-450M builds it (no pooling head)."""
PHOTOS = (
    [(640, 480)],
    [(1920, 1080), (300, 1200)],  # tiles and a thumbnail, and a tall strip resized whole
    [(512, 512), (96, 640), (1024, 768)],
)
"""Each call's photos, (width, height) in pixels."""


def processed(photos: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random photos of ``photos`` as LFM2-VL's image processor gives them, on the GPU."""
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    generator = torch.Generator().manual_seed(len(photos))
    images = [
        torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
        for width, height in photos
    ]
    batch = Lfm2VlImageProcessor()(images, return_tensors="pt")
    return {
        "pixel_values": batch["pixel_values"].to("cuda", dtype),
        "pixel_attention_mask": batch["pixel_attention_mask"].cuda(),
        "spatial_shapes": batch["spatial_shapes"].cuda(),
    }


def features(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every image's projected features, joined, as the VLM reads them."""
    return torch.cat(list(model.get_image_features(**inputs).pooler_output))


def test_lfm2_vl_450m_width_tower_graphs_equal_eager_in_bf16() -> None:
    torch.manual_seed(0)
    text = dict(TEXT, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    config = transformers.Lfm2VlConfig(
        vision_config=BASE, text_config=text, projector_hidden_size=512
    )
    with torch.device("cuda"):
        model = transformers.Lfm2VlForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    calls = [processed(photos, torch.bfloat16) for photos in PHOTOS]
    tolerance = DEFAULT_TOLERANCE[torch.bfloat16]
    reference = copy.deepcopy(model).float()
    with torch.inference_mode():
        exact = [
            features(reference, dict(c, pixel_values=c["pixel_values"].float())) for c in calls
        ]
        expected = [features(model, c) for c in calls]
        del reference
        graphed = layergraph.wrap(model, observe_calls=0, compile_layers=False)
        for inputs, want, truth in zip(calls, expected, exact):
            got = features(model, inputs)
            assert got.shape == want.shape
            bound = max(tolerance, 1.25 * relative_error(want.float(), truth))
            assert relative_error(got.float(), truth) <= bound
    assert graphed.adapter.name == "siglip2"
    stats = graphed.stats
    assert stats.replays > 0
    assert stats.eager_total == 0 or stats.slower_graphs, dict(stats.eager_calls)
    graphed.unwrap()


@pytest.mark.usefixtures("float32_without_tf32")
def test_the_tiny_vlm_image_features_and_generate_read_the_graphs() -> None:
    model = lfm2_vl().cuda()
    inputs = {name: t.cuda() for name, t in call([(4, 6), (2, 2)], patches=30).items()}
    prompt = torch.tensor([[1, *[IMAGE_TOKEN] * 6, 2, IMAGE_TOKEN, 3]], device="cuda")
    with torch.inference_mode():
        want = features(model, inputs)
        logits = model(input_ids=prompt, **inputs).logits
        tokens = model.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
        graphed = layergraph.wrap(model, batch_sizes=[64], compile_layers=False)
        assert relative_error(features(model, inputs), want) <= TOLERANCE
        assert relative_error(graphed(input_ids=prompt, **inputs).logits, logits) <= TOLERANCE
        generated = graphed.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, tokens)
    stats = graphed.stats
    assert stats.captures == 1
    assert stats.replays + stats.eager_total == 3  # get_image_features, forward, prefill
    assert stats.eager_total == 0 or stats.slower_graphs, dict(stats.eager_calls)
    graphed.unwrap()
