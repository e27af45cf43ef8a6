"""Models holding several towers: each tower served in place by its own plan under one
wrapper, the graphs in one pool, each tower's stats of its own; found without knowing any
model (:func:`layergraph.multi_tower.find_towers`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import IMAGE_TOKEN, VLMS, WIDTH, images, text, vision
from torch import nn
from torch.utils import _pytree as pytree

import layergraph
from layergraph.multi_tower import TOWER_DEPTH, GraphedTowers, find_towers, options_for
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4


def video_llava() -> nn.Module:
    """A tiny Video-LLaVA: a CLIP image tower and a CLIP video tower, each read at layer -2."""
    config = transformers.VideoLlavaConfig(
        vision_config=vision("CLIPVisionConfig")(),
        text_config=text("llama"),
        image_token_index=IMAGE_TOKEN,
        video_token_index=IMAGE_TOKEN - 1,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    return transformers.VideoLlavaForConditionalGeneration(config).eval()


class CountingPools(SimulatedGraphs):
    """Simulated graphs that count the pools made."""

    def __init__(self) -> None:
        super().__init__()
        self.pools_made = 0

    def new_pool(self) -> Any:
        self.pools_made += 1
        return super().new_pool()


def assert_close(got: Any, want: Any) -> None:
    pairs = zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True)
    for mine, theirs in pairs:
        if isinstance(theirs, torch.Tensor):
            assert relative_error(mine, theirs) <= TOLERANCE


def test_each_tower_is_served_in_place_from_one_pool_with_stats_of_its_own() -> None:
    model = video_llava()
    frames, pictures = images(1, 8), images(2)
    prompt = torch.tensor([[1, 2, *[IMAGE_TOKEN] * 17 * 2, 3]])
    backend = CountingPools()
    with torch.inference_mode():
        want_images = model.get_image_features(pictures)
        want_video = model.model.get_video_features(frames)
        want_logits = model(input_ids=prompt, pixel_values_images=pictures).logits
        graphed = layergraph.wrap(model, backend=backend)
        assert isinstance(graphed, GraphedTowers)
        assert sorted(graphed.towers) == ["model.image_tower", "model.video_tower"]
        assert_close(model.get_image_features(pictures), want_images)
        assert_close(model.model.get_video_features(frames), want_video)
        got_logits = graphed(input_ids=prompt, pixel_values_images=pictures).logits
    assert relative_error(got_logits, want_logits) <= TOLERANCE
    stats = graphed.stats
    assert stats["model.video_tower"].replays == 1
    assert stats["model.image_tower"].replays == 2 and stats["model.image_tower"].eager_total == 0
    assert backend.pools_made == 1, "the towers' graphs share one pool"
    assert all(stat.pool_bytes == stats["model.image_tower"].pool_bytes for stat in stats.values())
    assert "model.image_tower: forward routed to the graphs" in graphed.changes
    assert graphed.unwrap() is model
    assert "forward" not in model.model.image_tower.__dict__
    assert "forward" not in model.model.video_tower.__dict__
    layergraph.wrap(model, backend=SimulatedGraphs()).unwrap()  # wrapped again after unwrap


def test_a_second_wrap_is_refused_and_a_failing_tower_undoes_the_others() -> None:
    model = video_llava()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with pytest.raises(TypeError, match="wrapped already \\(by a wrapper of its towers\\)"):
        layergraph.wrap(model, backend=SimulatedGraphs())
    graphed.unwrap()
    image_wrapper = layergraph.wrap(model.model.image_tower, backend=SimulatedGraphs())
    with pytest.raises(TypeError, match="CLIPVisionModel is wrapped already"):
        layergraph.wrap(model, backend=SimulatedGraphs())
    assert "forward" not in model.model.video_tower.__dict__, "the video tower is undone"
    assert "forward" in model.model.image_tower.__dict__, "the other wrapper keeps its tower"
    image_wrapper.unwrap()


def test_options_go_to_the_towers_that_take_them_and_warm_start_is_refused() -> None:
    model = video_llava()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), fuse_qkv=False)
    assert {tower.speed_options["fuse_qkv"] for tower in graphed.towers.values()} == {"off"}
    graphed.unwrap()
    with pytest.raises(TypeError, match="'stack' is taken by none of the towers' adapters"):
        layergraph.wrap(model, backend=SimulatedGraphs(), stack="layers")
    with pytest.raises(ValueError, match=r"holds 2 \(model.video_tower, model.image_tower\)"):
        layergraph.wrap(model, backend=SimulatedGraphs(), warm_start="towers.pt")
    assert "forward" not in model.model.image_tower.__dict__


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)


class Holder(nn.Module):
    def __init__(self, *towers: str) -> None:
        super().__init__()
        for name in towers:
            self.add_module(name, Tower())
        self.layers = nn.ModuleList([Tower() for _ in range(2)])


def recognise_towers(part: nn.Module) -> str | None:
    """Towers and their inner modules are recognised (as a tower holding its transformer is);
    a holder of exactly one tower too."""
    if isinstance(part, (Tower, nn.Linear)):
        return "tower"
    towers = [child for child in part.children() if isinstance(child, Tower)]
    return "holder" if len(towers) == 1 else None


def test_towers_are_the_shallowest_parts_above_exactly_one_recognised_leaf() -> None:
    assert TOWER_DEPTH == 4
    model = nn.Module()
    model.model = Holder("image", "video")
    model.single = Holder("audio")
    found = find_towers(model, recognise_towers)
    assert found == {"single": "holder", "model.image": "tower", "model.video": "tower"}
    deep = nn.Module()
    deep.a = nn.Module()
    deep.a.b = nn.Module()
    deep.a.b.c = nn.Module()
    deep.a.b.c.d = nn.Module()
    deep.a.b.c.d.tower = Tower()  # five levels down: not looked at
    assert find_towers(deep, lambda part: "tower" if isinstance(part, Tower) else None) == {}


def test_an_option_no_tower_takes_is_named() -> None:
    class Takes:
        def __init__(self, fuse_qkv: bool = True) -> None: ...

    class Other:
        def __init__(self, attention: str = "auto") -> None: ...

    shares = options_for({"a": Takes, "b": Other}, {"fuse_qkv": False, "attention": "sdpa"})
    assert shares == {"a": {"fuse_qkv": False}, "b": {"attention": "sdpa"}}
    with pytest.raises(TypeError, match="'budget' is taken by none of the towers' adapters"):
        options_for({"a": Takes}, {"budget": 3})


def vision_encoder_decoder() -> nn.Module:
    """A tiny ViT encoder and GPT-2 decoder: the encoder is any vision model."""
    encoder = transformers.ViTConfig(image_size=32, patch_size=8, **WIDTH)
    decoder = transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=100, add_cross_attention=True, is_decoder=True
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    return transformers.VisionEncoderDecoderModel(config).eval()


def depth_pro() -> nn.Module:
    """A tiny DepthPro: two DINOv2 encoders (patches at two scales, and the whole image)."""
    dinov2 = dict(
        model_type="dinov2",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    config = transformers.DepthProConfig(
        patch_model_config=dinov2,
        image_model_config=dinov2,
        fov_model_config=dinov2,
        fusion_hidden_size=32,
        intermediate_hook_ids=[0, 1],
        intermediate_feature_dims=[16, 16],
        scaled_images_ratios=[0.5, 1.0],
        scaled_images_overlap_ratios=[0.0, 0.25],
        scaled_images_feature_dims=[16, 16],
        patch_size=32,
        use_fov_model=False,
    )
    torch.manual_seed(0)
    return transformers.DepthProModel(config).eval()


def pi0() -> nn.Module:
    """A tiny PI0 policy: a PaliGemma (SigLIP tower, Gemma) at ``model.vlm``, a Gemma DiT."""
    paligemma = dict(
        model_type="paligemma",
        vision_config=vision("SiglipVisionConfig")(),
        text_config=text("gemma", head_dim=16),
        image_token_id=IMAGE_TOKEN,
    )
    dit = dict(
        model_type="gemma",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=300,
    )
    torch.manual_seed(0)
    return transformers.PI0ForConditionalGeneration(
        transformers.PI0Config(vlm_config=paligemma, dit_config=dit)
    ).eval()


def colpali() -> nn.Module:
    """A tiny ColPali retriever: a PaliGemma (SigLIP tower, Gemma) at ``vlm``."""
    paligemma = VLMS["PaliGemmaForConditionalGeneration"].config()
    torch.manual_seed(0)
    config = transformers.ColPaliConfig(vlm_config=paligemma, embedding_dim=16)
    return transformers.ColPaliForRetrieval(config).eval()


def colpali_page_embeddings(model: nn.Module) -> torch.Tensor:
    """Two pages' multi-vector embeddings: each page's image tokens, then a few words."""
    vision_config = model.vlm.config.vision_config
    tokens = (vision_config.image_size // vision_config.patch_size) ** 2
    ids = torch.tensor([[IMAGE_TOKEN] * tokens + [1, 2, 3]] * 2)
    return model(input_ids=ids, pixel_values=images(2)).embeddings


IN_PLACE = {
    "VisionEncoderDecoderModel": (
        vision_encoder_decoder,
        lambda model: (
            model(
                pixel_values=images(2), decoder_input_ids=torch.tensor([[1, 2, 3], [1, 4, 5]])
            ).logits
        ),
    ),
    "DepthProModel": (depth_pro, lambda model: model(torch.randn(1, 3, 64, 64)).last_hidden_state),
    "PI0ForConditionalGeneration": (
        pi0,
        lambda model: model.model.vlm.get_image_features(images(2)).pooler_output,
    ),
    "ColPaliForRetrieval": (colpali, colpali_page_embeddings),
}
"""Models no adapter recognises, whose towers are served in place, and what a caller reads."""


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_towers_inside_a_model_no_adapter_knows_are_served_in_place(name: str) -> None:
    build, read = IN_PLACE[name]
    model = build()
    with torch.inference_mode():
        torch.manual_seed(1)
        want = read(model)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        torch.manual_seed(1)
        got = read(graphed)
    assert isinstance(graphed, GraphedTowers)
    assert relative_error(got, want) <= TOLERANCE
    assert all(s.replays >= 1 and s.eager_total == 0 for s in graphed.stats.values())
    assert graphed.unwrap() is model


def test_a_tower_an_adapter_serves_only_inside_models_it_knows_is_left_out() -> None:
    model = nn.Module()
    model.known = Holder("visual")  # a holder the tower's adapter recognises
    model.unknown = nn.Module()
    model.unknown.visual = Tower()  # a holder no adapter recognises

    def recognise(part: nn.Module) -> str | None:
        if isinstance(part, Tower) or (isinstance(part, Holder) and hasattr(part, "visual")):
            return "packed"
        return None

    found = find_towers(model, recognise, inside_any_model=lambda adapter: adapter != "packed")
    assert found == {"known": "packed"}
