"""The open_clip adapter on small open_clip models built from configurations (random weights,
nothing downloaded): its own VisionTransformer (class token, attentional pooler and
``output_tokens``), a timm-backed tower, alone and inside CLIP and CustomTextCLIP models; graphs
simulated on the CPU, every answer compared with eager's on fresh random images."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs

open_clip = pytest.importorskip("open_clip")
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg, CustomTextCLIP  # noqa: E402

TOLERANCE = 1e-5
TEXT = CLIPTextCfg(context_length=8, vocab_size=64, width=32, heads=2, layers=1)


def clip(**vision: Any) -> torch.nn.Module:
    """A two-layer CLIP of 64x64 images (patches of 16) with open_clip's VisionTransformer."""
    torch.manual_seed(0)
    config = CLIPVisionCfg(
        layers=2, width=64, head_width=32, patch_size=16, image_size=64, **vision
    )
    return CLIP(embed_dim=32, vision_cfg=config, text_cfg=TEXT).eval()


def timm_clip() -> torch.nn.Module:
    """A CustomTextCLIP whose tower is timm's vit_tiny (as open_clip's SigLIP models)."""
    pytest.importorskip("timm")
    torch.manual_seed(0)
    config = CLIPVisionCfg(timm_model_name="vit_tiny_patch16_224", image_size=224, timm_pool="avg")
    return CustomTextCLIP(embed_dim=32, vision_cfg=config, text_cfg=TEXT).eval()


MODELS = {
    "clip": clip,
    "clip-attentional-pool": lambda: clip(attentional_pool=True),
    "custom-text-clip-timm": timm_clip,
}


def images(batch: int, model: torch.nn.Module | None = None) -> torch.Tensor:
    side = 224 if model is not None and hasattr(model, "trunk") else 64
    return torch.randn(batch, 3, side, side)


def assert_close(got: Any, want: Any) -> None:
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_encode_image_of_a_whole_model_comes_from_the_graphs(kind: str) -> None:
    model = MODELS[kind]()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "open_clip"
    assert graphed.changes[0] == "visual: forward routed to the graphs"
    with torch.inference_mode():
        for batch in (2, 3, 2):
            x = images(batch, model.visual)
            got = model.encode_image(x)
            with graphed.original():
                want = model.encode_image(x)
            assert_close(got, want)
        text = torch.randint(0, 64, (2, 8))
        x = images(2, model.visual)
        both = model(x, text)  # image features, text features, logit scale
        with graphed.original():
            assert_close(tuple(both[:2]), tuple(model(x, text)[:2]))
    stats = graphed.stats
    assert stats.graphs == 2 and stats.replays >= 2 and stats.eager_total == 0
    assert graphed.unwrap() is model and "forward" not in model.visual.__dict__


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_tower_alone_is_graphed_whole(kind: str) -> None:
    tower = MODELS[kind]().visual
    graphed = layergraph.wrap(tower, backend=SimulatedGraphs())
    assert graphed.adapter.name == "open_clip" and graphed.plan.serves_forward
    with torch.inference_mode():
        x = images(4, tower)
        got = graphed(x)
        with graphed.original():
            assert_close(got, tower(x))
    assert len(graphed.keys) == 1 and graphed.keys[0].batch == 4
    assert len(graphed.plan.layers()) == (2 if kind.startswith("clip") else 12)
    graphed.unwrap()


@pytest.mark.parametrize("pool", [False, True], ids=["class-token", "attentional-pool"])
def test_output_tokens_come_back_as_eagers_tuple(pool: bool) -> None:
    tower = clip(attentional_pool=pool, output_tokens=True).visual
    graphed = layergraph.wrap(tower, backend=SimulatedGraphs())
    with torch.inference_mode():
        x = images(2)
        pooled, tokens = graphed(x)
        with graphed.original():
            assert_close((pooled, tokens), tower(x))
    assert pooled.shape == (2, 32) and tokens.dim() == 3 and tokens.shape[0] == 2
    graphed.unwrap()


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (torch.randn(2, 3, 96, 96), r"image size 96x96 differs from the tower's 64x64"),
        (torch.randn(2, 1, 64, 64), r"expected 3 channels, got 1"),
        (torch.randn(3, 64, 64), r"expected images of shape \[batch, channels, height, width\]"),
    ],
)
def test_bad_images_get_a_clear_error_and_leave_no_graph(image: torch.Tensor, message: str) -> None:
    model = clip()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        model.encode_image(image)
    assert graphed.stats.graphs == 0 and graphed.stats.captures == 0
    graphed.unwrap()


def test_auto_names_the_open_clip_adapter_and_it_refuses_other_models() -> None:
    from layergraph.adapter import AdapterMismatch, PlanContext
    from layergraph_adapters.open_clip import OpenClipAdapter

    adapter = OpenClipAdapter()
    assert adapter.recognizes(clip()) and adapter.recognizes(clip().visual)
    assert not adapter.recognizes(torch.nn.Linear(2, 2))
    with pytest.raises(AdapterMismatch, match="open_clip's VisionTransformer and TimmModel"):
        adapter.plan(torch.nn.Linear(2, 2), PlanContext(registry=None))  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["ViT-B-32", "ViT-B-16-SigLIP", "coca_ViT-B-32"])
def test_open_clip_models_on_the_gpu_equal_eager(name: str) -> None:
    """Real open_clip architectures in bf16, random weights: encode_image from CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None).cuda().to(torch.bfloat16).eval()
    size = model.visual.image_size if hasattr(model.visual, "image_size") else (224, 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    graphed = layergraph.wrap(model)
    with torch.inference_mode():
        for batch in (1, 4, 3):
            x = torch.randn(batch, 3, *size, device="cuda", dtype=torch.bfloat16)
            got = model.encode_image(x).float()
            with graphed.original():
                want = model.encode_image(x).float()
            assert (got - want).norm() / want.norm() <= 2e-2
    assert graphed.stats.graphs >= 1
    graphed.unwrap()


@pytest.mark.parametrize("kind", ["clip", "custom-text-clip-timm"])
def test_speed_options_rewrite_the_tower_and_keep_its_answers(kind: str) -> None:
    """patch_matmul and fuse_gelu asked for on the CPU (fuse_norm runs on a GPU or in Triton's
    interpreter: tests/test_fused_norm.py): the rewrites are listed and undone, and the answers
    stay within the tanh GELU's difference from the exact one."""
    model = MODELS[kind]()
    x = images(3, model.visual)
    with torch.inference_mode():
        want = model.encode_image(x)
        graphed = layergraph.wrap(
            model, backend=SimulatedGraphs(), patch_matmul=True, fuse_gelu="approximate"
        )
        got = model.encode_image(x)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert graphed.stats.replays == 1
    changes = "\n".join(graphed.changes)
    layers = len(graphed.plan.layers())
    assert changes.count("(fuse_gelu)") == layers and changes.count("(patch_matmul)") == 1
    graphed.unwrap()
    with torch.inference_mode():
        assert torch.equal(model.encode_image(x), want)


def test_automatic_speed_options_stay_off_on_the_cpu_and_say_why() -> None:
    graphed = layergraph.wrap(clip(), backend=SimulatedGraphs())
    assert set(graphed.speed_options) == {"patch_matmul", "fuse_norm", "fuse_gelu"}
    assert all(value.startswith("off:") for value in graphed.speed_options.values())
    graphed.unwrap()


def test_a_quick_gelu_tower_refuses_fuse_gelu() -> None:
    config = CLIPVisionCfg(layers=1, width=64, head_width=32, patch_size=16, image_size=64)
    model = CLIP(embed_dim=32, vision_cfg=config, text_cfg=TEXT, quick_gelu=True).eval()
    with pytest.raises(ValueError, match="fuses GELU only; Sequential's activation is QuickGELU"):
        layergraph.wrap(model, backend=SimulatedGraphs(), fuse_gelu=True)
    assert layergraph.wrap(model, backend=SimulatedGraphs()).unwrap() is model


def _benchmark_models() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
        return importlib.import_module("embedding_models")


ARCHITECTURES = _benchmark_models().OPEN_CLIP_MODELS
"""open_clip's architectures that embedding users run most (the benchmarks' list)."""


def one_block(name: str) -> torch.nn.Module:
    """open_clip's ``name`` built from its configuration with one block per tower (the towers'
    shapes, image sizes, pooling and classes as configured; depth does not change the plan)."""
    import copy

    from open_clip.coca_model import CoCa

    config = copy.deepcopy(open_clip.get_model_config(name))
    for part in ("vision_cfg", "text_cfg", "multimodal_cfg"):
        if "layers" in config.get(part, {}):
            config[part]["layers"] = 1
    custom = config.pop("custom_text", False)
    config.pop("init_logit_bias", None)
    kind = CoCa if name.startswith("coca") else CustomTextCLIP if custom else CLIP
    torch.manual_seed(0)
    model = kind(**config).eval()
    if hasattr(model.visual, "trunk"):  # a timm tower: its depth comes from timm's name
        model.visual.trunk.blocks = model.visual.trunk.blocks[:1]
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_common_architecture_is_recognised_and_served(name: str) -> None:
    model = one_block(name)
    visual = model.visual
    size = visual.image_size if hasattr(visual, "image_size") else visual.trunk.patch_embed.img_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    x = torch.randn(2, 3, *size)
    with torch.inference_mode():
        want = model.encode_image(x)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = model.encode_image(x)
    assert graphed.adapter.name == "open_clip"
    assert_close(got, want)
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0
    graphed.unwrap()


def test_any_open_clip_architecture_is_an_example_model_of_the_bench() -> None:
    """``layergraph bench --model open_clip:NAME``: the architecture's image tower with random
    weights, and images of its size; the listed names and unknown ones."""
    from layergraph import UnknownAdapterError
    from layergraph.bench.examples import example_model, example_model_names

    assert "open_clip:ViT-L-14" in example_model_names()
    example = example_model("open_clip:ViT-B-16-SigLIP")
    tower = example.build(torch.float32, torch.device("cpu"))
    (x,), _ = example.inputs(2, torch.float32, torch.device("cpu"))
    assert x.shape == (2, 3, 224, 224) and example.adapter == "open_clip"
    graphed = layergraph.wrap(tower, backend=SimulatedGraphs())
    with torch.inference_mode():
        got = graphed(x)
        with graphed.original():
            want = tower(x)
    assert_close(got, want)
    graphed.unwrap()
    with pytest.raises(UnknownAdapterError, match="open_clip:NAME"):
        example_model("open_clip:ViT-Z-99")
