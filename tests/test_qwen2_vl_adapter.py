"""The qwen2_vl adapter: Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's packed vision towers served per
token budget.

On the CPU through simulated graphs: every answer must equal the unwrapped tower's on fresh
random inputs within 1e-4 relative error (float32; about 1e-6 is seen: the graphs' attention
is one masked product over all tokens where the tower splits per frame or window). The towers'
attention is sharpened (:func:`sharpen`) so that wrong positions or boundaries show: rotary
positions all zero give errors near 1.
"""

from __future__ import annotations

import functools
import random
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packed_helpers import skip_unless_served
from torch.utils import _pytree as pytree

import layergraph
from layergraph import AdapterMismatch
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("layergraph_adapters.qwen2_vl")
skip_unless_served("qwen2_vl")

TOLERANCE = 1e-4
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,  # windows of 2x2 merged tokens: 16 patches
    out_hidden_size=32,
    fullatt_block_indexes=[1, 3],
)
VISION_QWEN2 = dict(
    depth=4,
    embed_dim=32,
    hidden_size=32,  # the merger's output
    mlp_ratio=2,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
)
KINDS = ("qwen2_vl", "qwen2_5_vl")
"""Qwen2-VL's tower (full attention in every layer) and Qwen2.5-VL's (windows)."""
ENTRIES = [(1, 2, 2), (1, 4, 6), (1, 6, 4), (1, 8, 8), (1, 6, 10), (2, 2, 2), (2, 4, 4)]
"""(t, h, w) in patches: an image smaller than one window (2x2), images of several windows,
videos of two frames."""


@pytest.fixture
def registry(layergraph_registry: Any) -> Any:
    """The registry with the qwen2_vl plugin: from the entry points where this checkout is
    installed, added here where an older install's entry points lack it."""
    if not layergraph_registry.plugin_manager.is_registered(qwen2_vl):
        layergraph_registry.add_plugin(qwen2_vl, "qwen2_vl")
    return layergraph_registry


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision attention's q, k and v weights drawn at scale 1: at the init
    scale (0.02) attention is so flat that rotary positions all zero change the outputs by less
    than the tolerance."""
    for module in model.modules():
        if type(module).__name__.endswith("VisionAttention"):
            torch.nn.init.normal_(module.qkv.weight, std=1.0)
    return model


def tower(kind: str = "qwen2_5_vl") -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    if kind == "qwen2_vl":
        config = transformers.Qwen2VLVisionConfig(**VISION_QWEN2)
        return sharpen(Qwen2VisionTransformerPretrainedModel(config).eval())
    config = transformers.Qwen2_5_VLVisionConfig(**VISION)
    return sharpen(Qwen2_5_VisionTransformerPretrainedModel(config).eval())


def vlm(kind: str) -> torch.nn.Module:
    """A VLM of ``kind`` with a one-layer text model."""
    torch.manual_seed(0)
    if kind == "qwen2_vl":
        config = transformers.Qwen2VLConfig(vision_config=VISION_QWEN2, text_config=TEXT)
        return sharpen(transformers.Qwen2VLForConditionalGeneration(config).eval())
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    return sharpen(transformers.Qwen2_5_VLForConditionalGeneration(config).eval())


def call(grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(-1).sum()), PATCH), grid


def check(graphed: Any, model: torch.nn.Module, grids: list[tuple[int, int, int]]) -> None:
    pixels, grid = call(grids)
    with torch.inference_mode():
        out = graphed(pixels, grid_thw=grid)
        with graphed.original():
            expected = model(pixels, grid_thw=grid)
    for name in ("pooler_output", "last_hidden_state"):
        got, want = getattr(out, name), getattr(expected, name)
        assert got.shape == want.shape, (grids, name)
        assert relative_error(got, want) <= TOLERANCE, (grids, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("registry")
def test_random_streams_are_served_by_few_budgets(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        adapter="qwen2_vl",
        backend=SimulatedGraphs(),
        budget_step=32,
        max_tokens=256,
    )
    rng = random.Random(0)
    mixes = set()
    for _ in range(16):
        grids = rng.choices(ENTRIES, k=rng.randint(1, 3))
        mixes.add(tuple(grids))
        check(graphed, model, grids)
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.graphs <= 6 < len(mixes)
    assert all(key.batch % 32 == 0 for key in graphed.keys)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("registry")
def test_equal_token_totals_with_other_images_read_their_own_boundaries(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[128]
    )
    for grids in ([(1, 4, 6), (2, 2, 2), (1, 8, 8)], [(1, 8, 8), (1, 6, 4), (2, 2, 2)]):
        check(graphed, model, grids)  # 96 tokens each, other frames and windows
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 2


@pytest.mark.usefixtures("registry")
def test_calls_above_every_budget_are_split_or_run_eagerly_with_the_reason() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[64, 128]
    )
    check(graphed, model, [(1, 8, 8), (1, 6, 10), (2, 4, 4)])  # 188 tokens: 64 + 60 + 64
    assert graphed.stats.split_calls == 1
    check(graphed, model, [(1, 16, 12)])  # 192 tokens in one image
    assert graphed.stats.eager_calls == {
        "an image of this call is above the largest token budget (128)": 1
    }


@pytest.mark.usefixtures("registry")
def test_budgets_that_would_pad_part_of_a_merged_token_are_refused_at_wrap() -> None:
    model = tower()
    with pytest.raises(ValueError, match=r"token budgets \[102\] are not multiples of 4 tokens"):
        layergraph.wrap(
            model,
            observe_calls=0,
            adapter="qwen2_vl",
            backend=SimulatedGraphs(),
            batch_sizes=[64, 102],
        )
    assert "forward" not in model.__dict__


@pytest.mark.parametrize(
    ("grid", "reason"),
    [
        (torch.zeros(0, 3, dtype=torch.long), "input grid_thw holds no image or video"),
        (torch.tensor([[1, 4, 4], [1, 3, 4]]), r"input grid_thw row \[1, 3, 4\]"),
    ],
)
@pytest.mark.usefixtures("registry")
def test_a_grid_the_tower_cannot_take_gets_the_reason_and_the_towers_error(
    grid: torch.Tensor, reason: str
) -> None:
    graphed = layergraph.wrap(
        tower(), observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs()
    )
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH)
    with torch.inference_mode(), pytest.raises(ValueError, match=f"{reason}.*the model raised"):
        graphed(pixels, grid_thw=grid)
    assert graphed.stats.graphs == 0


@functools.cache
def windowed_plan() -> Any:
    """The plan of a wrapped Qwen2.5-VL tower (windows of 2x2 merged tokens)."""
    return layergraph.wrap(
        tower(), observe_calls=0, adapter=qwen2_vl.Qwen2VLAdapter(), backend=SimulatedGraphs()
    ).plan


@settings(max_examples=60, deadline=None)
@given(
    grids=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 12)),
        min_size=1,
        max_size=6,
    )
)
def test_window_slots_hold_every_calls_windows(grids: list[tuple[int, int, int]]) -> None:
    from transformers.vision_utils import get_vision_window_index

    plan = windowed_plan()
    merge = 2
    grid = torch.tensor([(t, h * merge, w * merge) for t, h, w in grids])
    _, cu_window_seqlens = get_vision_window_index(grid, merge, VISION["window_size"], 14)
    tokens, frames = int(grid.prod(-1).sum()), int(grid[:, 0].sum())
    windows = cu_window_seqlens.numel() - 1
    assert windows <= plan.window_slots(tokens, frames) <= tokens // 4


def test_a_7b_shaped_towers_windows_fit_the_triton_grid_at_the_largest_learnt_budget() -> None:
    """Qwen2.5-VL-7B's tower: 16 heads, windows of 4x4 merged tokens (112 pixels); the Triton
    kernel launches at most 65535 sequences times heads at once (more in parts). One window
    slot per merged token (4096 at 16384 tokens) would exceed it: several launches, of
    programs mostly for empty windows."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = transformers.Qwen2_5_VLVisionConfig(
        **dict(VISION, depth=1, hidden_size=256, num_heads=16, window_size=112)
    )
    adapter = qwen2_vl.Qwen2VLAdapter()
    model = Qwen2_5_VisionTransformerPretrainedModel(config)
    plan = layergraph.wrap(model, observe_calls=0, adapter=adapter, backend=SimulatedGraphs()).plan
    assert plan.window_slots(adapter.max_tokens, 8) * plan.heads <= 65535


@pytest.mark.usefixtures("registry", "runnable_triton")
def test_the_triton_kernel_reads_the_budgets_boundaries() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        adapter="qwen2_vl",
        attention="triton",
        backend=SimulatedGraphs(),
        batch_sizes=[96],
    )
    for grids in ([(1, 2, 2), (2, 4, 4)], [(1, 6, 10), (1, 2, 2)]):
        check(graphed, model, grids)
    assert graphed.stats.graphs == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("registry")
def test_the_vlm_image_features_go_through_the_graphs(kind: str) -> None:
    model = vlm(kind)
    assert qwen2_vl.Qwen2VLAdapter().recognizes(model)
    assert qwen2_vl.Qwen2VLAdapter().recognizes(model.model)  # the tower at visual
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="auto", backend=SimulatedGraphs(), budget_step=32
    )
    for grids in ([(1, 4, 6), (1, 2, 2)], [(1, 8, 8)]):
        pixels, grid = call(grids)
        with torch.inference_mode():
            got = model.get_image_features(pixels, image_grid_thw=grid).pooler_output
            with graphed.original():
                want = model.get_image_features(pixels, image_grid_thw=grid).pooler_output
        assert [t.shape for t in got] == [t.shape for t in want]
        for part, expected in zip(got, want):
            assert relative_error(part, expected) <= TOLERANCE
    assert graphed.stats.replays == 2
    assert graphed.stats.eager_total == 0
    graphed.unwrap()
    assert "forward" not in model.model.visual.__dict__


def wrapped_after_two_observed_calls(model: torch.nn.Module, backend: SimulatedGraphs) -> Any:
    """``model`` wrapped with budgets learnt from two observed calls, of 100 and 28 tokens:
    budgets 32 and 128 planned, none captured yet."""
    graphed = layergraph.wrap(
        model, observe_calls=2, adapter="qwen2_vl", backend=backend, budget_step=32
    )
    check(graphed, model, [(1, 8, 8), (1, 6, 6)])
    check(graphed, model, [(1, 4, 6), (1, 2, 2)])
    return graphed


@pytest.mark.usefixtures("registry")
def test_a_budget_slower_than_eager_sends_its_calls_to_a_larger_one_measured_faster() -> None:
    model = tower()
    backend = SimulatedGraphs(
        eager_ms=lambda tokens: 10.0, replay_ms=lambda tokens: 20.0 if tokens < 50 else 1.0
    )
    graphed = wrapped_after_two_observed_calls(model, backend)
    check(graphed, model, [(1, 6, 6), (1, 8, 8)])  # both captured; 128 faster than eager
    check(graphed, model, [(1, 4, 6), (1, 2, 2)])  # 32 not measured faster than eager, dropped
    check(graphed, model, [(1, 6, 4), (1, 2, 2)])  # 28 tokens again, other windows
    stats = graphed.stats
    assert stats.budgets == (32, 128) and stats.captures == 2
    assert [key.batch for key in graphed.keys] == [128]
    assert stats.slower_graphs == 1
    assert stats.served[(28, "padded to 128")] == 2
    assert stats.eager_total == 2  # the calls observed


class CountedEagerCalls(SimulatedGraphs):
    """Simulated graphs that note the tokens of every eager call they time."""

    def __init__(self, **costs: Any) -> None:
        super().__init__(**costs)
        self.timed: list[int] = []

    def time_eager(self, fn: Any, rows: int) -> tuple[Any, float]:
        self.timed.append(rows)
        return super().time_eager(fn, rows)


@pytest.mark.usefixtures("registry")
def test_a_graph_decisively_faster_than_the_eager_calls_observed_times_none_of_its_own() -> None:
    model = tower()
    backend = CountedEagerCalls(
        eager_ms=lambda tokens: 10.0, replay_ms=lambda tokens: 8.0 if tokens < 50 else 1.0
    )
    graphed = wrapped_after_two_observed_calls(model, backend)
    assert backend.timed == [100, 28]
    # 100 tokens again: budget 128's replay (1 ms) is ten times faster than the 10 ms observed
    check(graphed, model, [(1, 6, 6), (1, 8, 8)])
    assert backend.timed == [100, 28]
    # 28 tokens: budget 32's replay (8 ms) is not 1.5 times faster than 10 ms: eager is timed
    check(graphed, model, [(1, 6, 4), (1, 2, 2)])
    assert backend.timed[:2] == [100, 28] and set(backend.timed[2:]) == {28}
    costs = graphed.stats.costs
    assert (costs[128].eager_ms, costs[128].graph_ms) == (10.0, 1.0)
    assert (costs[32].eager_ms, costs[32].graph_ms) == (10.0, 8.0)
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 2


VISION_QWEN3 = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=16,  # a 4x4 table, interpolated to every grid
    deepstack_visual_indexes=[1, 2],
)


def qwen3_vlm() -> torch.nn.Module:
    """A Qwen3-VL with a one-layer text model."""
    torch.manual_seed(0)
    config = transformers.Qwen3VLConfig(
        vision_config=VISION_QWEN3, text_config=dict(TEXT, head_dim=16)
    )
    return sharpen(transformers.Qwen3VLForConditionalGeneration(config).eval())


@pytest.mark.usefixtures("registry")
def test_qwen3_vl_learned_positions_and_deepstack_features_equal_the_towers() -> None:
    model = qwen3_vlm().model.visual
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        adapter="qwen2_vl",
        backend=SimulatedGraphs(),
        budget_step=32,
        max_tokens=256,
    )
    rng = random.Random(0)
    for grids in (
        [(1, 4, 6), (2, 2, 2), (1, 8, 8)],
        [(1, 8, 8), (1, 6, 4), (2, 2, 2)],  # 96 tokens again, other grids
        *(rng.choices(ENTRIES, k=rng.randint(1, 3)) for _ in range(6)),
    ):
        pixels, grid = call(grids)
        with torch.inference_mode():
            out = graphed(pixels, grid_thw=grid)
            with graphed.original():
                expected = model(pixels, grid_thw=grid)
        got_leaves = [out.last_hidden_state, out.pooler_output, *out.deepstack_features]
        want_leaves = [
            expected.last_hidden_state,
            expected.pooler_output,
            *expected.deepstack_features,
        ]
        assert len(got_leaves) == len(want_leaves) == 4
        for got, want in zip(got_leaves, want_leaves):
            assert got.shape == want.shape, grids
            assert relative_error(got, want) <= TOLERANCE, grids
    assert graphed.stats.eager_total == 0, dict(graphed.stats.eager_calls)
    assert graphed.stats.replays == 8


@pytest.mark.usefixtures("registry")
def test_qwen3_vl_image_features_and_their_deepstack_features_go_through_the_graphs() -> None:
    model = qwen3_vlm()
    adapter = qwen2_vl.Qwen2VLAdapter()
    assert adapter.recognizes(model) and adapter.recognizes(model.model)
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="auto", backend=SimulatedGraphs(), budget_step=32
    )
    for grids in ([(1, 4, 6), (1, 2, 2)], [(1, 8, 8)]):
        pixels, grid = call(grids)
        with torch.inference_mode():
            got = model.get_image_features(pixels, image_grid_thw=grid)
            with graphed.original():
                want = model.get_image_features(pixels, image_grid_thw=grid)
        assert len(got.pooler_output) == len(want.pooler_output) == len(grids)
        # Deep-stack features: one tensor per feature layer (transformers 5.17), or per layer
        # and image (5.24).
        got_parts = pytree.tree_leaves((got.pooler_output, got.deepstack_features))
        want_parts = pytree.tree_leaves((want.pooler_output, want.deepstack_features))
        assert len(got_parts) == len(want_parts) >= 2 + len(grids)
        for part, expected in zip(got_parts, want_parts):
            assert part.shape == expected.shape
            assert relative_error(part, expected) <= TOLERANCE
        assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    assert graphed.stats.replays == 2
    assert graphed.stats.eager_total == 0
    graphed.unwrap()
    assert "forward" not in model.model.visual.__dict__


@pytest.mark.usefixtures("registry")
def test_generate_reads_the_image_features_from_the_graphs() -> None:
    text = dict(
        TEXT,
        bos_token_id=1,
        eos_token_id=127,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
    )
    config = transformers.Qwen2_5_VLConfig(
        vision_config=VISION,
        text_config=text,
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Qwen2_5_VLForConditionalGeneration(config).eval())
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])  # 6 and 1 merged tokens
    prompt = torch.tensor([[2, 122, *[120] * 6, 123, 3, 122, 120, 123, 4]])
    inputs = dict(input_ids=prompt, pixel_values=pixels, image_grid_thw=grid)
    with torch.inference_mode():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        graphed = layergraph.wrap(
            model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs()
        )
        assert relative_error(graphed(**inputs).logits, logits) <= TOLERANCE
        assert torch.equal(graphed.generate(**inputs, max_new_tokens=4, do_sample=False), tokens)
    assert graphed.stats.replays == 2  # the forward's and generate's prefill
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model


@pytest.mark.usefixtures("registry")
def test_releases_without_precomputed_tower_arguments_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.0")
    model = tower()
    with pytest.raises(AdapterMismatch, match="qwen2_vl adapter was checked with transformers"):
        layergraph.wrap(model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs())
    assert "forward" not in model.__dict__


def test_colqwen2_reads_its_page_embeddings_from_the_vlms_graphs() -> None:
    """ColQwen2 calls its VLM's tower itself (unpadding the processor's pixels first): the
    tower is served in place inside the VLM, which no adapter knows the retriever of."""
    text = dict(
        TEXT, rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3])
    )
    vlm_config = transformers.Qwen2VLConfig(
        vision_config=VISION_QWEN2,
        text_config=text,
        image_token_id=120,
        video_token_id=121,
        vision_start_token_id=122,
        vision_end_token_id=123,
    )
    torch.manual_seed(0)
    config = transformers.ColQwen2Config(vlm_config=vlm_config, embedding_dim=16)
    model = transformers.ColQwen2ForRetrieval(config).eval()
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])  # 6 and 1 merged tokens, a page each
    ids = torch.full((2, 10), 5)
    ids[0, 1:7], ids[1, 1] = 120, 120
    padded = torch.zeros(2, 24, pixels.shape[1])  # as the processor pads each page's patches
    padded[0], padded[1, :4] = pixels[:24], pixels[24:]
    inputs = dict(input_ids=ids, pixel_values=padded, image_grid_thw=grid)
    with torch.inference_mode():
        want = model(**inputs).embeddings
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0, budget_step=32)
        got = model(**inputs).embeddings
    assert relative_error(got, want) <= TOLERANCE
    assert {path: tower.adapter.name for path, tower in graphed.towers.items()} == {
        "vlm": "qwen2_vl"
    }
    assert graphed.stats["vlm"].replays == 1 and graphed.stats["vlm"].eager_total == 0
    assert graphed.unwrap() is model
