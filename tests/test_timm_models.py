"""Every timm model a user runs: the hybrid and windowed transformers, timm's own ViT variants
and the convnets, built with ``pretrained=False`` at their default sizes, recognised by
``adapter="auto"`` and served by graphs of their whole forward, equal to eager on the faithful
replay (which refuses what a CUDA capture refuses) at two batch sizes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

timm = pytest.importorskip("timm")

MODELS: dict[str, dict[str, Any]] = {
    "vit_tiny_r_s16_p8_224": {},  # a hybrid ViT: a ResNet stem before the patch projection
    "vit_small_r26_s32_224": {},
    "vitamin_small_224": {},  # a hybrid whose projection is an identity
    "vit_relpos_small_patch16_224": {},
    "samvit_base_patch16": {"img_size": 256},
    "beit_base_patch16_224": {},
    "cait_xxs24_224": {},
    "xcit_nano_12_p16_224": {},
    "levit_128s": {},
    "pit_ti_224": {},
    "crossvit_tiny_240": {},
    "twins_svt_small": {},
    "swin_tiny_patch4_window7_224": {},
    "swinv2_tiny_window8_256": {},
    "swinv2_cr_tiny_224": {},
    "maxvit_nano_rw_256": {},
    "hiera_tiny_224": {},
    "mvitv2_tiny": {},
    "efficientvit_b0": {},
    "efficientvit_m0": {},
    "fastvit_t8": {},
    "tiny_vit_5m_224": {},
    "convit_tiny": {},
    "davit_tiny": {},
    "pvt_v2_b0": {},
    "mobilevit_xxs": {},
    "naflexvit_base_patch16_gap": {},
    "convnext_atto": {},
    "resnet50": {},
    "tresnet_m": {},  # a space-to-depth stem: 48 channels into its first convolution
}
"""The models the coverage issue found refused or failing, with what they are built with."""


def build(name: str, **settings: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **settings).eval()


def images(model: torch.nn.Module, batch: int, seed: int, channels: int = 3) -> torch.Tensor:
    _, height, width = model.pretrained_cfg.get("input_size", (3, 224, 224))
    if getattr(model, "patch_embed", None) is not None and hasattr(model.patch_embed, "img_size"):
        height, width = model.patch_embed.img_size or (height, width)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, height, width, generator=generator)


def served_equal(graphed: Any, model: torch.nn.Module, calls: list[torch.Tensor]) -> None:
    with torch.inference_mode():
        for x in calls:
            got = graphed(x)
            with graphed.original():
                want = model(x)
            for mine, theirs in zip(_tensors(got), _tensors(want), strict=True):
                assert mine.shape == theirs.shape
                # The replay runs eager's kernels, up to how PyTorch folds a linear layer's
                # batch dimensions under a dispatch mode (the recorder is one): Twins-SVT's
                # strided q/k/v input goes to a matrix product of another shape, 3e-7 apart.
                assert relative_error(mine, theirs) <= 1e-6


def _tensors(output: Any) -> list[torch.Tensor]:
    return list(output) if isinstance(output, (list, tuple)) else [output]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_timm_model_is_served_whole_and_answers_as_eager(name: str) -> None:
    model = build(name, **MODELS[name])
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "timm"
    served_equal(graphed, model, [images(model, 1, 0), images(model, 2, 1)])
    stats = graphed.stats
    assert stats.replays == 2 and stats.eager_total == 0 and stats.failed_captures == 0


@pytest.mark.parametrize("name", ["resnet18", "swin_tiny_patch4_window7_224"])
def test_features_only_models_return_the_eager_feature_maps(name: str) -> None:
    model = build(name, features_only=True, out_indices=(1, 3))
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    served_equal(graphed, model, [images(model, 2, 3)])
    assert graphed.stats.replays == 1


def test_images_are_checked_against_the_models_own_channels() -> None:
    """A hybrid ViT's patch projection takes its stem's channels, not the image's: the check
    reads the first convolution's."""
    model = build("vit_tiny_r_s16_p8_224", in_chans=1)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    served_equal(graphed, model, [images(model, 2, 4, channels=1)])
    with torch.inference_mode(), pytest.raises(ValueError, match="expected 1 channels, got 3"):
        graphed(images(model, 1, 5))
    assert graphed.stats.replays == 1


def test_speed_options_that_do_not_fit_a_model_are_refused_with_the_reason() -> None:
    with pytest.raises(layergraph.AdapterMismatch, match="fuse_norm serves timm's"):
        layergraph.wrap(build("swin_tiny_patch4_window7_224"), fuse_norm=True)
    with pytest.raises(ValueError, match="patch_matmul needs a patch embedding"):
        layergraph.wrap(build("resnet18"), patch_matmul=True)
    with pytest.raises(ValueError, match=r"fuse_gelu needs MLPs of the form"):
        layergraph.wrap(build("resnet18"), fuse_gelu=True)
    graphed = layergraph.wrap(build("resnet18"), backend=SimulatedGraphs())  # "auto"
    assert all(value.startswith("off") for value in graphed.plan.speed_options.values())


SPEED_MODELS = {
    "swin_tiny_patch4_window7_224": {},
    "beit_base_patch16_224": {},
    "cait_xxs24_224": {},
    "samvit_base_patch16": {"img_size": 256},
    "vit_relpos_small_patch16_224": {},
}
"""Transformers captured whole whose patch embedding and GELU MLPs take the speed options
(Hiera's overlapping patch convolution is no patch matrix product: its GELU MLPs only)."""


@pytest.mark.parametrize("name", [*sorted(SPEED_MODELS), "hiera_tiny_224"])
def test_patch_matmul_and_fuse_gelu_serve_the_transformers_captured_whole(name: str) -> None:
    model = build(name, **SPEED_MODELS.get(name, {}))
    patches = name in SPEED_MODELS
    graphed = layergraph.wrap(
        model, backend=SimulatedGraphs(), patch_matmul=patches, fuse_gelu="approximate"
    )
    assert graphed.plan.speed_options == {
        "patch_matmul": "on" if patches else "off",
        "fuse_gelu": "on",
        "fuse_norm": f"off: fuse_norm serves timm's VisionTransformer blocks; the blocks of "
        f"{type(model).__name__} are of another form",
    }
    assert any("patch_matmul" in what for what in graphed.changes) == patches
    assert any("fuse_gelu" in what for what in graphed.changes)
    with torch.inference_mode():
        for batch, seed in ((1, 9), (2, 10)):
            x = images(model, batch, seed)
            got = graphed(x)
            with graphed.original():
                want = model(x)
            assert relative_error(got, want) <= 5e-3  # the tanh GELU for the exact one
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0


@pytest.mark.parametrize(
    "name",
    ["vit_small_patch16_224", "resnet18", "swin_tiny_patch4_window7_224", "eva02_tiny_patch14_224"],
)
def test_forward_features_and_forward_head_are_served_and_counted(name: str) -> None:
    """Each method called through the wrapper replays a graph of its own, keyed by the method;
    the model called directly runs eagerly and reaches no graph."""
    model = build(name)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with torch.inference_mode():
        for batch, seed in ((1, 6), (2, 7)):
            x = images(model, batch, seed)
            with graphed.original():
                features = model.forward_features(x)
                want = (features, model.forward_head(features), model.forward_head(features, True))
            got = (
                graphed.forward_features(x),
                graphed.forward_head(features),
                graphed.forward_head(features, pre_logits=True),
            )
            for mine, theirs in zip(got, want, strict=True):
                assert relative_error(mine, theirs) == 0.0
            direct = model.forward_features(x)  # the model itself, not through the wrapper
            assert relative_error(direct, features) == 0.0
    stats = graphed.stats
    assert stats.replays == 6 and stats.eager_total == 0, dict(stats.eager_calls)
    methods = {str(key.sequence).split(":")[0] for key in graphed.keys}
    assert methods == {"forward_features", "forward_head"}
    assert len(graphed.keys) == 6, "one graph per method, fixed argument and batch size"
    graphed.unwrap()
    assert "forward_features" not in vars(model) and "forward_head" not in vars(model)


@pytest.mark.parametrize(
    "name", ["vit_small_patch16_224", "resnet18", "convnext_atto", "hiera_tiny_224"]
)
def test_forward_intermediates_replays_a_graph_per_choice_of_layers(name: str) -> None:
    """``forward_intermediates`` through the wrapper replays a graph keyed by the method and its
    arguments (which layers, ``intermediates_only``); every feature map equals eager's."""
    model = build(name)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    choices = ({"indices": 2}, {"indices": [0, 1], "intermediates_only": True})
    with torch.inference_mode():
        for (batch, seed), options in itertools.product(((1, 8), (3, 9)), choices):
            x = images(model, batch, seed)
            with graphed.original():
                want = torch.utils._pytree.tree_leaves(model.forward_intermediates(x, **options))
            got = torch.utils._pytree.tree_leaves(graphed.forward_intermediates(x, **options))
            assert len(got) == len(want) == 2 + ("intermediates_only" not in options)
            for mine, theirs in zip(got, want, strict=True):
                assert mine.shape == theirs.shape and relative_error(mine, theirs) == 0.0
    stats = graphed.stats
    assert stats.replays == 4 and stats.eager_total == 0, dict(stats.eager_calls)
    assert {str(key.sequence).split(":")[0] for key in graphed.keys} == {"forward_intermediates"}
    assert len(graphed.keys) == 4, "one graph per choice of layers and batch size"
    graphed.unwrap()
    assert "forward_intermediates" not in vars(model)


def test_a_wrapped_forward_reaches_forward_features_inside_one_graph() -> None:
    """``forward`` calls ``forward_features`` inside: one graph of the whole forward, not a
    graph of the features and an eager head."""
    model = build("resnet18")
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    served_equal(graphed, model, [images(model, 2, 8)])
    assert graphed.stats.replays == 1 and [str(k.sequence) for k in graphed.keys] == [
        "224x224 images"
    ]


def test_bad_features_for_the_head_are_refused_by_name() -> None:
    graphed = layergraph.wrap(build("resnet18"), backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=r"features are torch\.int64"):
        graphed.forward_head(torch.ones(2, 512, 7, 7, dtype=torch.long))
    assert graphed.stats.graphs == 0


def naflex_batch(
    grids: list[tuple[int, int]], tokens: int, seed: int, patch: int = 16
) -> dict[str, torch.Tensor]:
    """Images of ``grids`` patches as timm's NaFlex collator pads them: ``tokens`` patches a
    row, coordinates (y, x), and which patches are real."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(grids)
    patches = torch.zeros(rows, tokens, patch * patch * 3)
    coords = torch.zeros(rows, tokens, 2, dtype=torch.long)
    valid = torch.zeros(rows, tokens, dtype=torch.bool)
    for row, (height, width) in enumerate(grids):
        count = height * width
        patches[row, :count] = torch.randn(count, patch * patch * 3, generator=generator)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        coords[row, :count] = torch.stack([ys.flatten(), xs.flatten()], dim=-1)
        valid[row, :count] = True
    return {"patches": patches, "patch_coord": coords, "patch_valid": valid}


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_map"])
def test_naflex_batches_of_any_image_sizes_replay_one_graph_per_row_length(name: str) -> None:
    """The embeddings read each image's grid on the host and run eagerly; the blocks and head
    replay a graph keyed by (rows, patches a row), whatever the images' sizes."""
    model = build(name)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    calls = [
        naflex_batch([(8, 8), (6, 10)], 64, seed=11),
        naflex_batch([(4, 12), (7, 7)], 64, seed=12),  # other sizes, the same row length
        naflex_batch([(10, 10)], 100, seed=13),
    ]
    with torch.inference_mode():
        for batch in calls:
            got = (graphed(batch), graphed(batch["patches"], **_coords(batch)))
            with graphed.original():
                want = model(batch)
            for answer in got:
                assert relative_error(answer, want) <= 1e-5
        image = images(model, 2, 14)  # images: the whole forward, per image size
        assert relative_error(graphed(image), model(image)) == 0.0  # the model itself: eager
        valid = torch.ones(2, 4, dtype=torch.bool)  # which timm's image path ignores
        assert relative_error(graphed(image, patch_valid=valid), model(image)) == 0.0
        no_coordinates = {"patches": calls[0]["patches"], "patch_valid": calls[0]["patch_valid"]}
        with pytest.raises(AssertionError, match="patch_coord is required"):
            graphed(no_coordinates)
    stats = graphed.stats
    assert stats.replays == 8 and stats.eager_total == 0, dict(stats.eager_calls)
    side = image.shape[-1]
    assert sorted(str(key.sequence) for key in graphed.keys) == [
        f"{side}x{side} images",
        "naflex: 100 patches a row",
        "naflex: 64 patches a row",
    ]


@pytest.mark.parametrize("rope_type", ["mixed", "axial"])
def test_naflex_batches_with_rotary_embeddings_replay_graphs(rope_type: str) -> None:
    """Rotary embeddings made per call reach the graph as a tensor: shared by the layers
    (``axial``) or one per layer (``mixed``, each block reading its own)."""
    model = build("naflexvit_base_patch16_gap", depth=3, rope_type=rope_type)
    with torch.no_grad():  # sharp attention, so that positions (and each layer's) weigh
        for block in model.blocks:
            block.attn.qkv.weight.normal_(std=1.0)
    if rope_type == "mixed":
        frequencies = model.rope.freqs  # [axes, layers, heads, dim]
        assert not torch.equal(frequencies[:, 0], frequencies[:, 1])
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    calls = [
        naflex_batch([(8, 8), (6, 10)], 64, seed=21),
        naflex_batch([(4, 12), (7, 9), (5, 5)], 64, seed=22),
        naflex_batch([(9, 11)], 100, seed=23),
    ]
    with torch.inference_mode():
        for batch in calls:
            got = graphed(batch)
            with graphed.original():
                want = model(batch)
            assert relative_error(got, want) <= 1e-5
    stats = graphed.stats
    assert stats.replays == 3 and stats.eager_total == 0, dict(stats.eager_calls)


def _coords(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"patch_coord": batch["patch_coord"], "patch_valid": batch["patch_valid"]}


def test_the_timm_examples_hand_written_graph_makes_sam_vits_positions_on_the_device() -> None:
    """SAM ViT indexes its relative position tables by ``torch.arange`` made on the host: a
    capture of its own forward is refused, and inside the timm example's ``capturable`` (what
    ``layergraph bench`` captures its hand-written graph in) it captures and replays as eager."""
    from layergraph.graphs import GraphCaptureError
    from layergraph_adapters.example_models.frameworks import timm_example

    model = build("samvit_base_patch16", img_size=256)
    x = images(model, 1, 5)
    backend = SimulatedGraphs()
    example = timm_example("timm:samvit_base_patch16")
    assert example is not None and example.capturable is not None
    with torch.inference_mode():
        with pytest.raises(GraphCaptureError, match="index tensor made on the host"):
            backend.capture(lambda: model(x), backend.new_pool(), 1)
        with example.capturable(model):
            graph, output = backend.capture(lambda: model(x), backend.new_pool(), 1)
        backend.replay(graph)
        assert relative_error(output, model(x)) == 0.0
