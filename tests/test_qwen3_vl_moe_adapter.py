"""The qwen2_vl adapter serving Qwen3-VL-MoE's vision tower (``Qwen3VLMoeVisionModel``), alone
and inside ``Qwen3VLMoeForConditionalGeneration``, per token budget.

Qwen3-VL-MoE's tower is Qwen3-VL's: a learned position table interpolated to each grid, rotary
positions, full attention per frame in every layer, a patch merger, and deep-stack features
(the hidden states of some layers, each through a merger of its own), returned as
``BaseModelOutputWithDeepstackFeatures``. On the CPU through simulated graphs (strict: a host
read inside a capture raises): every answer must equal the unwrapped model's on fresh random
inputs within 1e-4 relative error (float32), in the merged features, the last hidden state and
every deep-stack feature. The tower's attention and position table are sharpened
(:func:`~test_qwen3_5_adapter.sharpen`), so that wrong boundaries or a table read at another
grid's rows give errors far above the tolerance.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest
import torch
from packed_helpers import skip_unless_served
from torch.utils import _pytree as pytree

import layergraph
from layergraph import AdapterMismatch
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("layergraph_adapters.qwen2_vl")
skip_unless_served("qwen3-vl-moe vision")
from test_qwen3_5_adapter import (  # noqa: E402
    ENTRIES,
    TOKENS,
    call,
    check_features_read_the_graphs,
    check_generate_reads_the_graphs,
    sharpen,
)

TOLERANCE = 1e-4
VISION = dict(
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
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    bos_token_id=1,
    eos_token_id=127,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
)
"""Two decoder layers of four experts; the deep-stack features are added to the first two."""


@pytest.fixture
def registry(layergraph_registry: Any) -> Any:
    """The registry with the qwen2_vl plugin: from the entry points where this checkout is
    installed, added here where an older install's entry points lack it."""
    if not layergraph_registry.plugin_manager.is_registered(qwen2_vl):
        layergraph_registry.add_plugin(qwen2_vl, "qwen2_vl")
    return layergraph_registry


def tower() -> torch.nn.Module:
    """A tiny ``Qwen3VLMoeVisionModel`` with two deep-stack mergers, sharpened, in eval
    mode."""
    torch.manual_seed(0)
    config = transformers.Qwen3VLMoeVisionConfig(**VISION)
    return sharpen(transformers.Qwen3VLMoeVisionModel(config).eval())


def vlm() -> torch.nn.Module:
    """A tiny ``Qwen3VLMoeForConditionalGeneration``, sharpened, in eval mode."""
    torch.manual_seed(0)
    config = transformers.Qwen3VLMoeConfig(
        vision_config=VISION, text_config=TEXT, vision_end_token_id=123, **TOKENS
    )
    return sharpen(transformers.Qwen3VLMoeForConditionalGeneration(config).eval())


def leaves(output: Any) -> list[torch.Tensor]:
    """What a caller reads from the tower or ``get_image_features``: the merged features (one
    tensor, or one per entry), the last hidden state and the deep-stack features (one tensor
    per feature layer with transformers 5.17, one per layer and entry with 5.24)."""
    return pytree.tree_leaves(
        (output.pooler_output, output.last_hidden_state, output.deepstack_features)
    )


def assert_equal_answers(got: Any, want: Any) -> None:
    """``got`` (through the graphs) equals ``want`` (the unwrapped model's): the same output
    class, and every tensor a caller reads within :data:`TOLERANCE`."""
    assert type(got) is type(want)
    got_parts, want_parts = leaves(got), leaves(want)
    assert len(got_parts) == len(want_parts)
    for part, expected in zip(got_parts, want_parts):
        assert part.shape == expected.shape
        assert relative_error(part, expected) <= TOLERANCE


@pytest.mark.usefixtures("registry")
def test_the_tower_and_its_deepstack_features_are_served_by_few_budgets() -> None:
    model = tower()
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
    calls = [
        [(1, 4, 6), (2, 2, 2), (1, 8, 8)],
        [(1, 8, 8), (1, 6, 4), (2, 2, 2)],  # 96 tokens again, other grids in another order
        *(rng.choices(ENTRIES, k=rng.randint(1, 4)) for _ in range(8)),
    ]
    for grids in calls:
        pixels, grid = call(grids)
        with torch.inference_mode():
            got = graphed(pixels, grid_thw=grid)
            with graphed.original():
                want = model(pixels, grid_thw=grid)
        assert len(want.deepstack_features) == 2
        assert_equal_answers(got, want)
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.replays == len(calls)
    assert stats.graphs <= 6 < len({tuple(grids) for grids in calls})


@pytest.mark.usefixtures("registry")
def test_the_vlms_image_and_video_features_go_through_the_graphs() -> None:
    def assert_same(got: Any, want: Any, grids: list[tuple[int, int, int]]) -> None:
        assert len(got.pooler_output) == len(grids)
        assert_equal_answers(got, want)

    check_features_read_the_graphs(vlm(), assert_same)


@pytest.mark.usefixtures("registry")
def test_generate_reads_the_image_features_from_the_graphs() -> None:
    check_generate_reads_the_graphs(vlm())


@pytest.mark.usefixtures("registry")
def test_releases_the_tower_was_not_checked_with_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    model = tower()
    layergraph.list_adapters()  # loading the plugins may put another transformers module object
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.25.0")
    with pytest.raises(AdapterMismatch, match=r"checked with transformers>=5\.17\.0,<5\.25"):
        layergraph.wrap(model, adapter="qwen2_vl", backend=SimulatedGraphs())
    assert "forward" not in model.__dict__
