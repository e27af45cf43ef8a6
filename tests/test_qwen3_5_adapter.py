"""The qwen2_vl adapter serving Qwen3.5's vision towers (``Qwen3_5VisionModel``,
``Qwen3_5MoeVisionModel``), alone and inside ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForConditionalGeneration``, per token budget.

A Qwen3.5 tower is Qwen3-VL's without the deep-stack mergers: a learned position table
interpolated to each grid, rotary positions, full attention per frame in every layer and a
patch merger, returned as ``BaseModelOutputWithPooling``. On the CPU through simulated graphs
(strict: a host read inside a capture raises): every answer must equal the unwrapped tower's
on fresh random inputs within 1e-4 relative error (float32; about 1e-6 is seen). The towers'
attention and position tables are sharpened (:func:`sharpen`), so that wrong boundaries or a
table read at another grid's rows give errors far above the tolerance.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from packed_helpers import skip_unless_served

import layergraph
from layergraph import AdapterMismatch
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("layergraph_adapters.qwen2_vl")
skip_unless_served("qwen3.5 vision")

TOLERANCE = 1e-4
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=16,  # a 4x4 table, interpolated to every grid
)
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    vocab_size=128,
    bos_token_id=1,
    eos_token_id=127,
)
TEXT_MOE = dict(
    TEXT,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
)
KINDS = {
    "qwen3_5": ("Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
}
"""Each Qwen3.5 tower: its configuration and model class."""
VLMS = {
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", TEXT),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", TEXT_MOE),
}
"""Each Qwen3.5 VLM: its configuration class and a tiny text configuration (one linear
attention layer, one full attention layer)."""
TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122)
ENTRIES = [(1, 2, 2), (1, 4, 6), (1, 6, 4), (1, 8, 8), (1, 6, 10), (2, 2, 2), (2, 4, 4)]
"""(t, h, w) in patches: images of several sizes, videos of two frames."""


@pytest.fixture
def registry(layergraph_registry: Any) -> Any:
    """The registry with the qwen2_vl plugin: from the entry points where this checkout is
    installed, added here where an older install's entry points lack it."""
    if not layergraph_registry.plugin_manager.is_registered(qwen2_vl):
        layergraph_registry.add_plugin(qwen2_vl, "qwen2_vl")
    return layergraph_registry


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision attention's q, k and v weights and its vision position table
    drawn at scale 1: at the init scale attention is so flat, and the table so small, that
    wrong boundaries or table rows change the outputs by less than the tolerance."""
    for module in model.modules():
        if type(module).__name__.endswith("VisionAttention"):
            torch.nn.init.normal_(module.qkv.weight, std=1.0)
        if type(module).__name__.endswith("VisionModel"):
            torch.nn.init.normal_(module.pos_embed.weight, std=1.0)
    return model


def tower(kind: str = "qwen3_5") -> torch.nn.Module:
    """A tiny Qwen3.5 tower of ``kind`` (a key of :data:`KINDS`), sharpened, in eval mode."""
    config_name, model_name = KINDS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**VISION)
    return sharpen(getattr(transformers, model_name)(config).eval())


def vlm(name: str = "Qwen3_5ForConditionalGeneration") -> torch.nn.Module:
    """A tiny Qwen3.5 VLM ``name`` (a key of :data:`VLMS`), sharpened, in eval mode."""
    config_name, text = VLMS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vision_config=VISION, text_config=text, **TOKENS)
    return sharpen(getattr(transformers, name)(config).eval())


def call(grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random patches of entries ``grids`` and their ``grid_thw``."""
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(-1).sum()), PATCH), grid


def check(graphed: Any, model: torch.nn.Module, grids: list[tuple[int, int, int]]) -> None:
    """One call of ``grids`` through ``graphed`` against ``model`` itself: the same output
    class, merged features and last hidden state."""
    pixels, grid = call(grids)
    with torch.inference_mode():
        out = graphed(pixels, grid_thw=grid)
        with graphed.original():
            expected = model(pixels, grid_thw=grid)
    assert type(out) is type(expected)
    assert out.keys() == expected.keys() == {"last_hidden_state", "pooler_output"}
    for name in ("pooler_output", "last_hidden_state"):
        got, want = getattr(out, name), getattr(expected, name)
        assert got.shape == want.shape, (grids, name)
        assert relative_error(got, want) <= TOLERANCE, (grids, name)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.usefixtures("registry")
def test_images_and_videos_of_mixed_sizes_are_served_by_few_budgets(kind: str) -> None:
    model = tower(kind)
    assert qwen2_vl.Qwen2VLAdapter().recognizes(model)
    graphed = layergraph.wrap(
        model,
        adapter="auto",
        backend=SimulatedGraphs(),
        observe_calls=0,
        budget_step=32,
        max_tokens=256,
    )
    assert graphed.adapter.name == "qwen2_vl"
    rng = random.Random(0)
    mixes = set()
    for _ in range(10):
        grids = rng.choices(ENTRIES, k=rng.randint(1, 4))
        mixes.add(tuple(grids))
        check(graphed, model, grids)
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.replays == 10
    assert stats.graphs <= 6 < len(mixes)


@pytest.mark.usefixtures("registry")
def test_equal_token_totals_read_their_own_grids_position_table_rows() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", backend=SimulatedGraphs(), observe_calls=0, batch_sizes=[128]
    )
    for grids in (
        [(1, 4, 6), (2, 2, 2), (1, 8, 8)],
        [(1, 8, 8), (1, 6, 4), (2, 2, 2)],  # 96 tokens each, other grids in another order
        [(1, 2, 2)] * 20,  # more frames than the first calls: a larger signature
    ):
        check(graphed, model, grids)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert graphed.stats.graphs == 2


@pytest.mark.usefixtures("registry")
def test_an_image_above_every_budget_runs_eagerly_and_the_rest_of_its_call_from_graphs() -> None:
    model = tower("qwen3_5_moe")
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", backend=SimulatedGraphs(), observe_calls=0, batch_sizes=[64, 128]
    )
    check(graphed, model, [(1, 8, 8), (1, 16, 12), (1, 6, 10)])  # 64 + 192 + 60 tokens
    stats = graphed.stats
    assert stats.split_calls == 1 and stats.replays == 2
    assert stats.eager_calls == {
        "an image of this call is above the largest token budget (128): it ran eagerly, the "
        "rest from graphs": 1
    }


@pytest.mark.usefixtures("registry", "runnable_triton")
def test_the_triton_kernel_reads_the_budgets_boundaries() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model,
        adapter="qwen2_vl",
        attention="triton",
        backend=SimulatedGraphs(),
        observe_calls=0,
        batch_sizes=[96],
    )
    for grids in ([(1, 2, 2), (2, 4, 4)], [(1, 6, 10), (1, 2, 2)]):
        check(graphed, model, grids)
    assert graphed.stats.graphs == 1 and graphed.stats.replays == 2


def check_features_read_the_graphs(
    model: torch.nn.Module, assert_same: Callable[[Any, Any, list[tuple[int, int, int]]], None]
) -> None:
    """A Qwen-like VLM's ``get_image_features()`` and ``get_video_features()`` through the
    graphs, ``assert_same(got, want, grids)`` against the unwrapped model's, each replayed from
    a graph; ``unwrap()`` gives the tower and its attention their own forwards back."""
    adapter = qwen2_vl.Qwen2VLAdapter()
    assert adapter.recognizes(model) and adapter.recognizes(model.model)
    graphed = layergraph.wrap(
        model, adapter="auto", backend=SimulatedGraphs(), observe_calls=0, budget_step=32
    )
    assert graphed.adapter.name == "qwen2_vl"
    for method, grids in (
        ("get_image_features", [(1, 4, 6), (1, 2, 2), (1, 6, 4)]),
        ("get_video_features", [(2, 4, 4), (4, 2, 2)]),
    ):
        pixels, grid = call(grids)
        features = getattr(model, method)
        with torch.inference_mode():
            got = features(pixels, grid)
            with graphed.original():
                want = features(pixels, grid)
        assert_same(got, want, grids)
    assert graphed.stats.replays == 2
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model
    assert "forward" not in model.model.visual.__dict__
    assert all("forward" not in block.attn.__dict__ for block in model.model.visual.blocks)


@pytest.mark.parametrize("name", sorted(VLMS))
@pytest.mark.usefixtures("registry")
def test_the_vlm_image_and_video_features_go_through_the_graphs(name: str) -> None:
    def assert_same(got: Any, want: Any, grids: list[tuple[int, int, int]]) -> None:
        assert [t.shape for t in got.pooler_output] == [t.shape for t in want.pooler_output]
        for part, expected in zip(got.pooler_output, want.pooler_output):
            assert relative_error(part, expected) <= TOLERANCE, grids
        assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE

    check_features_read_the_graphs(vlm(name), assert_same)


def check_generate_reads_the_graphs(model: torch.nn.Module) -> None:
    """``model``'s logits and ``generate()`` tokens for a prompt of two images equal the
    unwrapped model's, with the images' features read from the graphs (for every Qwen-like
    VLM whose image tokens are 120, between 122 and 123)."""
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])  # 6 and 1 merged tokens
    prompt = torch.tensor([[2, 122, *[120] * 6, 123, 3, 122, 120, 123, 4]])
    inputs = dict(
        input_ids=prompt,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=(prompt == 120).long(),
    )
    with torch.inference_mode():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0)
        assert relative_error(graphed(**inputs).logits, logits) <= TOLERANCE
        captures = graphed.stats.captures
        assert torch.equal(graphed.generate(**inputs, max_new_tokens=4, do_sample=False), tokens)
    assert graphed.adapter.name == "qwen2_vl"
    assert graphed.stats.replays == 2  # the forward's and generate's prefill
    assert graphed.stats.captures == captures  # generate's use_cache needs no graph of its own
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model


@pytest.mark.parametrize("name", sorted(VLMS))
@pytest.mark.usefixtures("registry")
def test_generate_reads_the_image_features_from_the_graphs(name: str) -> None:
    check_generate_reads_the_graphs(vlm(name))


@pytest.mark.usefixtures("registry")
def test_releases_the_qwen3_5_towers_were_not_checked_with_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    model = tower()
    layergraph.list_adapters()  # loading the plugins may put another transformers module object
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.25.0")
    with pytest.raises(AdapterMismatch, match=r"checked with transformers>=5\.17\.0,<5\.25"):
        layergraph.wrap(model, adapter="qwen2_vl", backend=SimulatedGraphs(), observe_calls=0)
    assert "forward" not in model.__dict__
