"""The timm adapter on the CPU: eager path, simulated graphs, keys and input checks.

Models are built from timm's configs with random weights (no download), shrunk to two blocks
so that the tests stay fast; the adapter's logic does not depend on depth. Tolerance: the
simulated graph recomputes in float32 on a zero-padded batch; rows are independent, so outputs
agree to 1e-4 relative (tested with ``torch.testing.assert_close``, rtol=1e-4, atol=1e-5).
"""

from __future__ import annotations

import pytest
import torch

timm = pytest.importorskip("timm")

import layergraph  # noqa: E402
from layergraph.testing import SimulatedGraphs, check_adapter  # noqa: E402
from layergraph_adapters.timm_vit import ImageTokens, TimmVisionTransformerAdapter  # noqa: E402

SMALL = {"depth": 2, "embed_dim": 64, "num_heads": 2}

VARIANTS = {
    "class token": ("vit_tiny_patch16_224", {}),
    "register tokens": ("vit_small_patch14_reg4_dinov2", {"img_size": 112}),
    "siglip in timm (no class token, attention pool)": ("vit_base_patch16_siglip_224", {}),
    "no class token, average pool": (
        "vit_tiny_patch16_224",
        {"class_token": False, "global_pool": "avg"},
    ),
    "deit distilled": ("deit_tiny_distilled_patch16_224", {}),
    "eva02 (rotary embeddings)": ("eva02_tiny_patch14_224", {}),
}


def build(name: str, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**SMALL, **overrides}).eval()


def images(model: torch.nn.Module, batch: int, size: tuple[int, int] | None = None) -> torch.Tensor:
    height, width = size or model.patch_embed.img_size
    return torch.randn(batch, 3, height, width)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_simulated_graph_equals_eager(variant: str) -> None:
    name, overrides = VARIANTS[variant]
    model = build(name, **overrides)
    graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), batch_sizes=[1, 4])
    with torch.inference_mode():
        for batch in (1, 3):
            x = images(model, batch)
            torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-5)
    stats = graphed.stats
    assert (stats.replays, stats.padded_calls, stats.eager_total) == (2, 1, 0)


@pytest.mark.parametrize(
    "variant",
    [
        "no class token, average pool",
        "siglip in timm (no class token, attention pool)",
        "class token",  # row-major already: the class token is concatenated
    ],
)
def test_blocks_get_row_major_tokens_while_wrapped(variant: str) -> None:
    name, overrides = VARIANTS[variant]
    model = build(name, **overrides)
    seen: list[bool] = []
    model.blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    x = images(model, 2)
    with torch.inference_mode():
        expected = model(x)
        graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), batch_sizes=[2])
        graphed.capture(x, progress=False)
        torch.testing.assert_close(graphed(x), expected, rtol=1e-4, atol=1e-5)
        wrapped = len(seen)
        with graphed.original() as original:
            torch.testing.assert_close(original(x), expected, rtol=0, atol=0)
        graphed.unwrap()
        model(x)
    own_layout = model.num_prefix_tokens > 0
    assert seen[0] is own_layout
    assert set(seen[1:wrapped]) == {True}
    assert seen[wrapped:] == [own_layout, own_layout]  # original(), then unwrapped
    assert not model.patch_embed._forward_hooks


def test_eager_path_without_cuda_equals_the_model() -> None:
    model = build("vit_tiny_patch16_224")
    graphed = layergraph.wrap(model, adapter="timm")
    x = images(model, 2)
    with torch.inference_mode():
        torch.testing.assert_close(graphed(x), model(x), rtol=0, atol=0)
    assert graphed.stats.eager_total == 1 and graphed.stats.graphs == 0


def test_eva_with_dynamic_image_size() -> None:
    model = build("eva02_tiny_patch14_224", dynamic_img_size=True)
    graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), batch_sizes=[4])
    with torch.inference_mode():
        for size in ((224, 224), (168, 252)):
            x = images(model, 3, size)
            torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-5)
    assert {key.sequence for key in graphed.keys} == {
        ImageTokens(257, 224, 224),
        ImageTokens(12 * 18 + 1, 168, 252),
    }


def test_key_sequence_is_tokens_and_image_size() -> None:
    model = build("vit_tiny_patch16_224", dynamic_img_size=True)
    graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), batch_sizes=[2])
    with torch.inference_mode():
        for size in ((224, 224), (160, 96)):
            x = images(model, 2, size)
            torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-5)
    sequences = {key.sequence for key in graphed.keys}
    assert sequences == {ImageTokens(197, 224, 224), ImageTokens(10 * 6 + 1, 160, 96)}
    assert str(ImageTokens(197, 224, 224)) == "197 tokens (224x224)"


@pytest.mark.parametrize(
    ("shape", "overrides", "message"),
    [
        ((2, 1, 224, 224), {}, "expected 3 channels, got 1"),
        ((2, 3, 160, 160), {}, "image size 160x160 differs from the model's 224x224"),
        ((2, 3, 100, 96), {"dynamic_img_size": True}, "not a multiple of the patch size 16x16"),
        ((2, 3, 224), {}, r"expected images of shape \[batch, channels, height, width\]"),
    ],
)
def test_bad_images_are_refused_before_capture(
    shape: tuple[int, ...], overrides: dict, message: str
) -> None:
    model = build("vit_tiny_patch16_224", **overrides)
    backend = SimulatedGraphs()
    graphed = layergraph.wrap(model, adapter="timm", backend=backend)
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        graphed(torch.randn(shape))
    assert graphed.stats.graphs == 0 and backend.captures == 0


@pytest.mark.parametrize("backend", [SimulatedGraphs, None], ids=["graphs", "eager path"])
def test_integer_images_get_an_error_naming_their_dtype(backend: type | None) -> None:
    model = build("vit_tiny_patch16_224")
    graphed = layergraph.wrap(model, adapter="timm", backend=backend() if backend else None)
    pixels = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"images are torch.uint8: .* / 255"),
    ):
        graphed(pixels)
    assert graphed.stats.graphs == 0


def test_other_models_are_refused_by_name() -> None:
    with pytest.raises(layergraph.AdapterMismatch, match=r"models timm builds.*got .*Linear"):
        layergraph.wrap(torch.nn.Linear(2, 2), adapter="timm")


def test_recognizes_the_models_timm_builds_and_nothing_else() -> None:
    adapter = TimmVisionTransformerAdapter()
    assert adapter.recognizes(build("vit_tiny_patch16_224"))
    assert adapter.recognizes(timm.create_model("resnet18", pretrained=False))
    assert not adapter.recognizes(torch.nn.Linear(2, 2))
    assert not adapter.recognizes(build("vit_tiny_patch16_224").blocks[0])  # a part, no model


@pytest.mark.parametrize("variant", ["class token", "eva02 (rotary embeddings)"])
def test_check_adapter_passes(variant: str) -> None:
    name, overrides = VARIANTS[variant]
    model = build(name, **overrides)
    result = check_adapter(model, "timm", lambda batch: ((images(model, batch),), {}))
    assert result.graphed.stats.padded_calls == 1 and result.graph_error is not None


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("vit_tiny_patch16_224", {"depth": 4}), ("eva02_tiny_patch14_224", {"depth": 3})],
)
def test_features_only_models_return_eagers_feature_maps_from_graphs(
    name: str, overrides: dict[str, object]
) -> None:
    """``features_only=True``: the intermediate feature maps (NCHW) of the layers asked for,
    from graphs of the whole feature forward; the blocks past the last one asked for pruned
    by timm, as eagerly."""
    torch.manual_seed(0)
    model = timm.create_model(
        name, pretrained=False, features_only=True, out_indices=(0, 2), **{**SMALL, **overrides}
    ).eval()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "timm" and len(graphed.plan.layers()) == 3
    size = model.model.patch_embed.img_size
    with torch.inference_mode():
        for batch in (2, 1, 2):
            x = torch.randn(batch, 3, *size)
            got = graphed(x)
            with graphed.original():
                want = model(x)
            assert len(got) == len(want) == 2 and got[0].dim() == 4
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    graphed.unwrap()


def test_token_features_come_from_graphs_with_the_head_reset() -> None:
    """What ``forward_features`` returns (the normed tokens) is the forward of a model whose
    classifier and pooling are reset (``reset_classifier(0, "")``), which the graphs serve."""
    model = build("vit_tiny_patch16_224")
    x = images(model, 2)
    with torch.inference_mode():
        want = model.forward_features(x)
        model.reset_classifier(0, "")
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        torch.testing.assert_close(graphed(x), want, rtol=1e-4, atol=1e-5)
    assert graphed.stats.replays == 1
    graphed.unwrap()


@pytest.mark.slow
def test_compiled_region_compiles_once_per_batch_size() -> None:
    """The region compiled (``compile_region``) runs its warm-ups and its capture on the code
    compiled at its first run: entering the routed methods' scopes changes nothing Dynamo
    guards on between calls, which would compile it again per call (or, with
    ``compile_budget`` spent, capture it uncompiled)."""
    from torch._dynamo.utils import counters

    model = build("vit_tiny_patch16_224", depth=1)
    torch._dynamo.reset()
    counters.clear()
    graphed = layergraph.wrap(
        model, adapter="timm", backend=SimulatedGraphs(), batch_sizes=[1, 2], compile_region=True
    )
    try:
        with torch.inference_mode():
            graphed.capture(images(model, 2), progress=False)
            for batch in (2, 1):
                x = images(model, batch)
                torch.testing.assert_close(graphed(x), model(x), rtol=1e-4, atol=1e-5)
        assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0
        assert counters["stats"]["unique_graphs"] == 2  # one per batch size
    finally:
        torch._dynamo.reset()
