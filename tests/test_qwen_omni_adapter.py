"""The qwen2_vl adapter serving the vision encoders of Qwen2.5-Omni's and Qwen3-Omni's
thinkers (``Qwen2_5OmniVisionEncoder``: Qwen2.5-VL's tower with separate q, k and v
projections; ``Qwen3OmniMoeVisionEncoder``: Qwen3-VL's), alone and inside the thinker, per
token budget. On the CPU through simulated graphs: every answer equals the unwrapped model's
on fresh random inputs within 1e-4 relative error (float32); attention and position tables
are sharpened so that wrong boundaries or windows give errors far above it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from packed_helpers import skip_unless_served
from torch.utils import _pytree as pytree

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("layergraph_adapters.qwen2_vl")
skip_unless_served("qwen omni vision")
from test_qwen3_5_adapter import ENTRIES, call  # noqa: E402

TOLERANCE = 1e-4
COMMON = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
)
QWEN2_5_OMNI = dict(COMMON, window_size=56, fullatt_block_indexes=[1, 3])
"""Windows of 2x2 merged patches in layers 0 and 2, full attention per frame in 1 and 3."""
QWEN3_OMNI = dict(COMMON, num_position_embeddings=16, deepstack_visual_indexes=[1, 2])
AUDIO = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    num_mel_bins=8,
    max_source_positions=50,
    n_window=10,
    output_dim=32,
)
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=160,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
)


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision attention's projections and position table drawn at scale 1,
    so that wrong boundaries, windows or table rows show far above :data:`TOLERANCE`."""
    for module in model.modules():
        if type(module).__name__.endswith("VisionAttention"):
            for name in ("q", "k", "v", "qkv"):
                if hasattr(module, name):
                    torch.nn.init.normal_(getattr(module, name).weight, std=1.0)
        if hasattr(module, "pos_embed") and type(module).__name__.endswith("Encoder"):
            torch.nn.init.normal_(module.pos_embed.weight, std=1.0)
    return model


def encoder(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2_5_omni":
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as modeling

        config = transformers.Qwen2_5OmniVisionEncoderConfig(**QWEN2_5_OMNI)
        return sharpen(modeling.Qwen2_5OmniVisionEncoder(config).eval())
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    config = transformers.Qwen3OmniMoeVisionEncoderConfig(**QWEN3_OMNI)
    return sharpen(modeling.Qwen3OmniMoeVisionEncoder(config).eval())


MOE_TEXT = dict(TEXT, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=16)
THINKERS = (
    "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeThinkerForConditionalGeneration",
)


def thinker(name: str = THINKERS[0]) -> torch.nn.Module:
    """A tiny Omni thinker ``name`` (audio tower, vision encoder, one text layer)."""
    if name == THINKERS[0]:
        config: Any = transformers.Qwen2_5OmniThinkerConfig(
            audio_config=AUDIO,
            vision_config=QWEN2_5_OMNI,
            text_config=TEXT,
            image_token_index=150,
            video_token_index=151,
            audio_token_index=152,
        )
    else:
        audio = dict(
            AUDIO,
            n_window=50,  # the one its audio tower's length function counts for
            max_source_positions=200,
            n_window_infer=200,
            conv_chunksize=50,
            downsample_hidden_size=16,
        )
        config = transformers.Qwen3OmniMoeThinkerConfig(
            audio_config=audio,
            vision_config=QWEN3_OMNI,
            text_config=MOE_TEXT,
            image_token_id=150,
            video_token_id=151,
            audio_token_id=152,
        )
    torch.manual_seed(0)
    return sharpen(getattr(transformers, name)(config).eval())


def assert_equal_answers(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    got_parts, want_parts = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert [p.shape for p in got_parts] == [p.shape for p in want_parts]
    for part, expected in zip(got_parts, want_parts, strict=True):
        assert relative_error(part, expected) <= TOLERANCE


@pytest.mark.parametrize("kind", ["qwen2_5_omni", "qwen3_omni"])
def test_the_encoder_alone_is_served_by_few_budgets(kind: str) -> None:
    model = encoder(kind)
    graphed = layergraph.wrap(
        model, backend=SimulatedGraphs(), observe_calls=0, budget_step=32, max_tokens=256
    )
    assert graphed.adapter.name == "qwen2_vl"
    rng = random.Random(1)
    calls = [[(1, 4, 6), (2, 2, 2)], *(rng.choices(ENTRIES, k=rng.randint(1, 3)) for _ in range(6))]
    for grids in calls:
        pixels, grid = call(grids)
        with torch.inference_mode():
            got = graphed(pixels, grid_thw=grid)
            with graphed.original():
                want = model(pixels, grid_thw=grid)
        assert_equal_answers(got, want)
    assert graphed.stats.eager_total == 0 and graphed.stats.replays == len(calls)
    assert graphed.stats.graphs < len({tuple(grids) for grids in calls})


@pytest.mark.parametrize("name", THINKERS)
def test_the_thinkers_image_and_video_features_go_through_the_graphs(name: str) -> None:
    model = thinker(name)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0, budget_step=32)
    visual = next(tower for path, tower in graphed.towers.items() if path.endswith("visual"))
    assert visual.adapter.name == "qwen2_vl"
    for method, grids in (
        ("get_image_features", [(1, 4, 6), (1, 2, 2)]),
        ("get_video_features", [(2, 4, 4)]),
    ):
        pixels, grid = call(grids)
        features = getattr(model, method)
        with torch.inference_mode():
            got = features(pixels, grid)
            with graphed.original():
                want = features(pixels, grid)
        assert_equal_answers(got, want)
    assert visual.stats.replays == 2 and visual.stats.eager_total == 0
    assert graphed.unwrap() is model
    visual = getattr(model, "visual", None) or model.model.visual  # 5.17 holds it at the top
    assert "forward" not in visual.__dict__
