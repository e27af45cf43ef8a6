"""sentence-transformers: a SentenceTransformer built from a small random CLIP saved locally
(nothing downloaded) embeds images from graphs (simulated on the CPU, float32: within 1e-5 of
its own embeddings on fresh random images), texts eagerly, and comes back whole from unwrap()."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs

sentence_transformers = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TOLERANCE = 1e-5
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def clip_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random CLIP saved locally by the benchmarks' builder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        save_clip = importlib.import_module("embedding_models").save_clip
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
        projection_dim=16,
    )
    return save_clip(tmp_path_factory.mktemp("clip"), vision)


def load(directory: Path) -> Any:
    return sentence_transformers.SentenceTransformer(str(directory), device="cpu")


def photos(count: int) -> list[Any]:
    """Random photos of several sizes, which the model's processor resizes and crops."""
    sizes = [(80, 90), (64, 64), (120, 70)]
    return [
        Image.fromarray((np.random.rand(*sizes[i % 3], 3) * 255).astype("uint8"))
        for i in range(count)
    ]


def test_encode_embeds_images_from_graphs_and_texts_eagerly(clip_directory: Path) -> None:
    model = load(clip_directory)
    images = photos(5)
    want = model.encode(images, batch_size=2, convert_to_tensor=True)
    texts = model.encode(["a cat", "dog"], convert_to_tensor=True)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "sentence_transformers"
    got = graphed.encode(images, batch_size=2, convert_to_tensor=True)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    same = model.encode(images, batch_size=2, convert_to_tensor=True)  # through the model too
    torch.testing.assert_close(same, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert graphed.stats.replays == 6 and graphed.stats.eager_total == 0  # batches 2, 2, 1
    torch.testing.assert_close(model.encode(["a cat", "dog"], convert_to_tensor=True), texts)
    fresh = photos(3)
    with graphed.original():
        reference = model.encode(fresh, convert_to_tensor=True)
    torch.testing.assert_close(
        model.encode(fresh, convert_to_tensor=True), reference, rtol=TOLERANCE, atol=TOLERANCE
    )
    tower = model[0].model.vision_model
    graphed.unwrap()
    assert "forward" not in tower.__dict__
    torch.testing.assert_close(model.encode(images, batch_size=2, convert_to_tensor=True), want)


def test_a_bfloat16_model_embeds_its_processors_float32_pixels_from_graphs(
    clip_directory: Path,
) -> None:
    """The processor makes float32 pixels whatever the model's dtype; CLIP's tower casts them,
    and so do its graphs (bfloat16's tolerance, 2e-2)."""
    model = sentence_transformers.SentenceTransformer(
        str(clip_directory), device="cpu", model_kwargs={"dtype": torch.bfloat16}
    )
    images = photos(3)
    want = model.encode(images, batch_size=2, convert_to_tensor=True).float()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    got = model.encode(images, batch_size=2, convert_to_tensor=True).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0
    graphed.unwrap()


def test_auto_prefers_it_to_the_generic_sequential_adapter(clip_directory: Path) -> None:
    from layergraph.plugins import get_registry

    assert get_registry().recognize(load(clip_directory)) == "sentence_transformers"


def test_options_go_to_the_adapter_of_the_model_inside(clip_directory: Path) -> None:
    model = load(clip_directory)
    with pytest.raises(TypeError, match="no_such_option"):
        layergraph.wrap(model, backend=SimulatedGraphs(), no_such_option=True)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), fuse_qkv=False)
    assert graphed.speed_options["fuse_qkv"] == "off"
    graphed.unwrap()


def test_a_text_only_model_is_not_taken_and_others_are_refused_clearly() -> None:
    from sentence_transformers.sentence_transformer.modules import Pooling

    from layergraph.adapter import AdapterMismatch, PlanContext
    from layergraph_adapters.sentence_transformers import SentenceTransformersAdapter

    adapter = SentenceTransformersAdapter()
    text_only = sentence_transformers.SentenceTransformer(modules=[Pooling(8)], device="cpu")
    assert not adapter.recognizes(text_only)
    with pytest.raises(AdapterMismatch, match="a module that takes images"):
        adapter.plan(text_only, PlanContext(registry=None))  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["clip-ViT-B-32", "clip-ViT-L-14"])
def test_checkpoint_shapes_on_the_gpu_equal_eager(name: str, tmp_path: Path) -> None:
    """sentence-transformers' CLIP checkpoints' shapes in bf16, random weights: ``encode`` of
    photos from CUDA graphs within bf16's tolerance (2e-2) of eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        models = importlib.import_module("embedding_models")
    models.save_clip(tmp_path, models.SENTENCE_TRANSFORMERS_CLIPS[name])
    model = sentence_transformers.SentenceTransformer(
        str(tmp_path), device="cuda", model_kwargs={"dtype": torch.bfloat16}
    )
    images = photos(7)
    with torch.inference_mode():
        want = model.encode(images, batch_size=4, convert_to_tensor=True).float()
    graphed = layergraph.wrap(model)
    with torch.inference_mode():
        got = model.encode(images, batch_size=4, convert_to_tensor=True).float()
    assert (got - want).norm() / want.norm() <= 2e-2
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0
    graphed.unwrap()
