"""The qwen2_vl adapter serving GLM's vision towers: GLM-4.1V's (``Glm4vVisionModel``, also
GLM-4.6V's), GLM-4.5V's (``Glm4vMoeVisionModel``), GLM-OCR's and GLM-5-Next's, alone and inside
their VLMs, per token budget.

On the CPU through simulated graphs (strict: a host read inside a capture raises): every
answer must equal the unwrapped tower's on fresh random inputs within 1e-4 relative error
(float32). The towers' attention and GLM-4.1V's position table are sharpened (:func:`sharpen`),
so that a frame read with another image's height and width (the position table resampled to
the wrong grid) or wrong boundaries give errors near 1.
"""

from __future__ import annotations

import copy
import random
import sys
from typing import Any

import pytest
import torch
from packed_helpers import skip_unless_served

import layergraph
from layergraph import AdapterMismatch
from layergraph.testing import SimulatedGraphs
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("layergraph_adapters.qwen2_vl")
skip_unless_served("glm vision")

TOLERANCE = 1e-4
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
)
VISION_GLM4V = dict(VISION, image_size=56)
"""GLM-4.1V's and GLM-4.5V's towers: a 4x4 learned position table, resampled to every grid."""
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
    pad_token_id=0,
)
TOWERS = {
    "glm4v": ("glm4v", "Glm4vVisionConfig", "Glm4vVisionModel", VISION_GLM4V),
    "glm4v_moe": ("glm4v_moe", "Glm4vMoeVisionConfig", "Glm4vMoeVisionModel", VISION_GLM4V),
    "glm_ocr": ("glm_ocr", "GlmOcrVisionConfig", "GlmOcrVisionModel", VISION),
    "glm5_next": ("glm5_next", "Glm5NextVisionConfig", "Glm5NextVisionModel", VISION),
}
"""Each GLM tower: its package, configuration and model class, and a tiny configuration."""
VLMS = {
    "Glm4vForConditionalGeneration": ("Glm4vConfig", VISION_GLM4V, TEXT),
    "Glm4vMoeForConditionalGeneration": (
        "Glm4vMoeConfig",
        VISION_GLM4V,
        dict(TEXT, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2),
    ),
    "Glm46VForConditionalGeneration": (
        "Glm46VConfig",
        dict(VISION_GLM4V, model_type="glm4v_vision"),
        dict(TEXT, model_type="glm4v_text"),
    ),
    "GlmOcrForConditionalGeneration": ("GlmOcrConfig", VISION, TEXT),
    "Glm5NextForConditionalGeneration": ("Glm5NextConfig", VISION, TEXT),
}
"""Each GLM VLM: its configuration class and tiny vision and text configurations."""
IMAGES = [(1, 2, 2), (1, 4, 6), (1, 6, 4), (1, 8, 8), (1, 6, 10), (1, 2, 8)]
"""(t, h, w) in patches. A GLM tower is given a video as one row per frame (its VLM's
``get_video_features`` does so), so every row holds one frame."""


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
    wrong positions change the outputs by less than the tolerance."""
    for module in model.modules():
        if type(module).__name__.endswith("VisionAttention"):
            torch.nn.init.normal_(module.qkv.weight, std=1.0)
        if type(module).__name__.endswith("VisionEmbeddings"):
            torch.nn.init.normal_(module.position_embedding.weight, std=1.0)
    return model


def tower(kind: str = "glm4v") -> torch.nn.Module:
    """A tiny GLM tower of ``kind`` (a key of :data:`TOWERS`), sharpened, in eval mode."""
    package, config_name, model_name, vision = TOWERS[kind]
    modeling = __import__(
        f"transformers.models.{package}.modeling_{package}", fromlist=[model_name]
    )
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**vision)
    return sharpen(getattr(modeling, model_name)(config).eval())


def vlm(name: str = "Glm4vForConditionalGeneration", **options: Any) -> torch.nn.Module:
    """A tiny GLM VLM ``name`` (a key of :data:`VLMS`) with a one-layer text model; ``options``
    go to its configuration."""
    config_name, vision, text = VLMS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vision_config=vision, text_config=text, **options)
    return sharpen(getattr(transformers, name)(config).eval())


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


@pytest.mark.parametrize("kind", sorted(TOWERS))
@pytest.mark.usefixtures("registry")
def test_mixed_image_sizes_are_served_by_few_budgets(kind: str) -> None:
    model = tower(kind)
    assert qwen2_vl.Qwen2VLAdapter().recognizes(model)
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        adapter="auto",
        backend=SimulatedGraphs(),
        budget_step=32,
        max_tokens=256,
    )
    rng = random.Random(0)
    mixes = set()
    for _ in range(10):
        grids = rng.choices(IMAGES, k=rng.randint(1, 4))
        mixes.add(tuple(grids))
        check(graphed, model, grids)
    stats = graphed.stats
    assert graphed.adapter.name == "qwen2_vl"
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.replays == 10
    assert stats.graphs <= 6 < len(mixes)


@pytest.mark.usefixtures("registry")
def test_equal_token_totals_read_their_own_images_heights_and_widths() -> None:
    """GLM-4.1V's position table is resampled to each frame's grid inside the graph, from the
    rows written into the budget's ``grid_thw`` buffer at each call."""
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[128]
    )
    for grids in (
        [(1, 4, 6), (1, 2, 8), (1, 8, 8)],
        [(1, 8, 8), (1, 6, 4), (1, 2, 8)],  # 104 tokens each, other grids in another order
        [(1, 2, 2)] * 26,  # more frames than the first calls: a larger signature
    ):
        check(graphed, model, grids)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert graphed.stats.graphs == 2


@pytest.mark.usefixtures("registry")
def test_an_image_above_every_budget_runs_eagerly_and_the_rest_of_its_call_from_graphs() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", backend=SimulatedGraphs(), batch_sizes=[64, 128]
    )
    check(graphed, model, [(1, 8, 8), (1, 16, 12), (1, 6, 10)])  # 64 + 192 + 60 tokens
    stats = graphed.stats
    assert stats.split_calls == 1 and stats.replays == 2
    assert stats.eager_calls == {
        "an image of this call is above the largest token budget (128): it ran eagerly, the "
        "rest from graphs": 1
    }


@pytest.mark.usefixtures("registry")
def test_an_entry_of_several_frames_runs_the_towers_own_forward_with_the_reason() -> None:
    """GLM-4.1V's forward reads ``grid_thw``'s rows by frame index, so an entry of two frames
    is out of its rows: the unwrapped tower raises, and so does the wrapped one, eagerly."""
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs())
    pixels, grid = call([(1, 4, 4), (2, 4, 4)])
    with torch.inference_mode(), graphed.original(), pytest.raises(IndexError):
        model(pixels, grid_thw=grid)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"several frames.*model raised"):
        graphed(pixels, grid_thw=grid)
    assert graphed.stats.graphs == 0


@pytest.mark.parametrize("kind", ["glm_ocr", "glm5_next"])
@pytest.mark.usefixtures("registry")
def test_towers_without_a_position_table_serve_entries_of_several_frames(kind: str) -> None:
    model = tower(kind)
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs(), budget_step=32
    )
    check(graphed, model, [(2, 4, 4), (1, 6, 4), (3, 2, 2)])
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0


@pytest.mark.usefixtures("registry", "runnable_triton")
def test_the_triton_kernel_reads_the_budgets_boundaries() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="qwen2_vl", attention="triton", backend=SimulatedGraphs(), batch_sizes=[96]
    )
    for grids in ([(1, 2, 2), (1, 8, 8)], [(1, 6, 10), (1, 2, 8)]):
        check(graphed, model, grids)
    assert graphed.stats.graphs == 1 and graphed.stats.replays == 2


@pytest.mark.parametrize("name", sorted(VLMS))
@pytest.mark.usefixtures("registry")
def test_the_vlm_image_and_video_features_go_through_the_graphs(name: str) -> None:
    model = vlm(name)
    adapter = qwen2_vl.Qwen2VLAdapter()
    assert adapter.recognizes(model) and adapter.recognizes(model.model)
    graphed = layergraph.wrap(
        model, observe_calls=0, adapter="auto", backend=SimulatedGraphs(), budget_step=32
    )
    assert graphed.adapter.name == "qwen2_vl"
    for method, grids in (
        ("get_image_features", [(1, 4, 6), (1, 2, 2), (1, 6, 4)]),
        ("get_video_features", [(2, 4, 4), (1, 2, 2)]),  # frames: one row each for the tower
    ):
        pixels, grid = call(grids)
        features = getattr(model.model, method)
        with torch.inference_mode():
            got = features(pixels, grid).pooler_output
            with graphed.original():
                want = features(pixels, grid).pooler_output
        assert [t.shape for t in got] == [t.shape for t in want], method
        for part, expected in zip(got, want):
            assert relative_error(part, expected) <= TOLERANCE, method
    assert graphed.stats.replays == 2
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model
    assert "forward" not in model.model.visual.__dict__
    assert all("forward" not in block.attn.__dict__ for block in model.model.visual.blocks)


@pytest.mark.usefixtures("registry")
def test_generate_reads_the_image_features_from_the_graphs() -> None:
    text = dict(
        TEXT,
        bos_token_id=1,
        eos_token_id=127,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e4, mrope_section=[1, 1, 2], partial_rotary_factor=0.5
        ),
    )
    config = transformers.Glm4vConfig(
        vision_config=VISION_GLM4V,
        text_config=text,
        image_token_id=120,
        video_token_id=121,
        image_start_token_id=122,
        image_end_token_id=123,
        video_start_token_id=124,
        video_end_token_id=125,
    )
    torch.manual_seed(0)
    model = sharpen(transformers.Glm4vForConditionalGeneration(config).eval())
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
        graphed = layergraph.wrap(
            model, observe_calls=0, adapter="qwen2_vl", backend=SimulatedGraphs()
        )
        assert relative_error(graphed(**inputs).logits, logits) <= TOLERANCE
        assert torch.equal(graphed.generate(**inputs, max_new_tokens=4, do_sample=False), tokens)
    assert graphed.stats.replays == 2  # the forward's and generate's prefill
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model


@pytest.mark.usefixtures("registry")
def test_releases_the_glm_towers_were_not_checked_with_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    model = tower()
    layergraph.list_adapters()  # loading the plugins may put another transformers module object
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.1")
    with pytest.raises(AdapterMismatch, match=r"checked with transformers>=5\.17\.0"):
        layergraph.wrap(model, adapter="qwen2_vl", backend=SimulatedGraphs())
    assert "forward" not in model.__dict__


@pytest.mark.cuda
def test_glm_4_1v_9b_tower_graphs_equal_eager_in_bf16() -> None:
    """GLM-4.1V-9B's vision tower (its configuration's defaults: 24 layers of 1536, 12 heads,
    patch 14, merge 2, 4096 out), random weights, bf16 on the GPU: graphs against the tower's
    own forward, both against a float32 copy of the same weights: the graphs' error at most
    bf16's tolerance (2e-2) or 1.25 times eager's own, whichever is larger (a 24-layer tower
    in bf16 is itself about 3e-2 from float32).
    A budget whose graph was not measured faster than eager serves its calls eagerly; at least one
    call must come from a graph."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    torch.manual_seed(0)
    config = transformers.Glm4vVisionConfig()
    with torch.device("cuda"):
        model = Glm4vVisionModel(config).to(torch.bfloat16).eval()
    calls = [[(1, 32, 32)], [(1, 16, 24), (1, 48, 32), (1, 4, 4)], [(1, 24, 16), (1, 16, 16)]]
    inputs = []
    for grids in calls:
        pixels, grid = call(grids)
        inputs.append((pixels.to("cuda", torch.bfloat16), grid.cuda()))
    tolerance = DEFAULT_TOLERANCE[torch.bfloat16]
    reference = copy.deepcopy(model).float()
    with torch.inference_mode():
        exact = [reference(p.float(), grid_thw=g).pooler_output for p, g in inputs]
        expected = [model(pixels, grid_thw=grid).pooler_output for pixels, grid in inputs]
        del reference
        graphed = layergraph.wrap(model, adapter="qwen2_vl", batch_sizes=[1024, 2048])
        for (pixels, grid), want, truth in zip(inputs, expected, exact):
            got = graphed(pixels, grid_thw=grid).pooler_output
            assert got.shape == want.shape
            bound = max(tolerance, 1.25 * relative_error(want.float(), truth))
            assert relative_error(got.float(), truth) <= bound
    assert graphed.stats.replays > 0
