"""The siglip2 adapter: SigLIP2 NaFlex towers served per token budget, alone and inside models.

On the CPU through simulated graphs: every answer must equal the unwrapped tower's on fresh
random inputs within 1e-4 relative error (float32; about 1e-7 is seen) at every real patch of
``last_hidden_state`` and in ``pooler_output``, and ``last_hidden_state`` must be exactly zero
at every padding position. Inputs are padded with random values, not zeros, so that padding
reaching a real patch shows. The towers' attention is sharpened (:func:`sharpen`): wrong
boundaries or positions give errors far above the tolerance.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from packed_helpers import RecordingPlugin

import layergraph
from layergraph import AdapterMismatch
from layergraph.attention import (
    DenseMaskedAttention,
    PackedLayout,
    SdpaMaskedAttention,
    block_mask,
)
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE

transformers = pytest.importorskip("transformers")
siglip2 = pytest.importorskip("layergraph_adapters.siglip2")
naflex = pytest.importorskip("layergraph_adapters.kit.naflex")
if not hasattr(transformers, "Siglip2VisionModel"):
    pytest.skip("this transformers has no Siglip2VisionModel", allow_module_level=True)

TOLERANCE = 1e-4
PATCH = 2
FEATURES = 3 * PATCH * PATCH
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,  # head_dim 16: the Triton kernel's smallest
    patch_size=PATCH,
    num_patches=16,  # a 4x4 position table, resized to every grid
)
TEXT = dict(
    model_type="lfm2",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=128,
    layer_types=["conv", "full_attention"],
)

IMAGE_TOKEN = 100
Grids = list[tuple[int, int]]


@pytest.fixture
def registry(layergraph_registry: Any) -> Any:
    """The registry with the siglip2 plugin: from the entry points where this checkout is
    installed, added here where an older install's entry points lack it."""
    if not layergraph_registry.plugin_manager.is_registered(siglip2):
        layergraph_registry.add_plugin(siglip2, "siglip2")
    return layergraph_registry


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision attention's q and k weights drawn at scale 1: at the init scale
    attention is nearly flat, and tokens of other images attended to would change the outputs
    by little."""
    for module in model.modules():
        if type(module).__name__ == "Siglip2Attention":
            torch.nn.init.normal_(module.q_proj.weight, std=1.0)
            torch.nn.init.normal_(module.k_proj.weight, std=1.0)
    return model


def tower(**settings: Any) -> torch.nn.Module:
    """A tiny ``Siglip2VisionModel`` with random weights (``settings`` override
    :data:`VISION`)."""
    torch.manual_seed(0)
    config = transformers.Siglip2VisionConfig(**{**VISION, **settings})
    return sharpen(transformers.Siglip2VisionModel(config).eval())


def lfm2_vl() -> torch.nn.Module:
    """An LFM2-VL whose tower is a tiny ``Siglip2VisionModel`` (no head, as LFM2-VL's)."""
    torch.manual_seed(0)
    config = transformers.Lfm2VlConfig(
        vision_config=dict(VISION, model_type="siglip2_vision_model", vision_use_head=False),
        text_config=TEXT,
        projector_hidden_size=32,
        downsample_factor=2,
        image_token_id=IMAGE_TOKEN,
    )
    return sharpen(transformers.Lfm2VlForConditionalGeneration(config).eval())


def call(grids: Grids, patches: int | None = None) -> dict[str, torch.Tensor]:
    """A padded batch of images of ``grids`` (height, width in patches), ``patches`` per image
    (default: the largest image's); the padding holds random values."""
    patches = patches or max(height * width for height, width in grids)
    mask = torch.zeros(len(grids), patches, dtype=torch.int32)
    for row, (height, width) in enumerate(grids):
        mask[row, : height * width] = 1
    return dict(
        pixel_values=torch.randn(len(grids), patches, FEATURES),
        pixel_attention_mask=mask,
        spatial_shapes=torch.tensor(grids),
    )


def assert_equal_outputs(got: Any, want: Any, inputs: dict[str, torch.Tensor]) -> None:
    """``got`` (the wrapped tower's) equals ``want`` (the tower's) at every real patch and in
    the pooled features, and is zero at every padding position."""
    real = inputs["pixel_attention_mask"].bool()
    hidden, expected = got.last_hidden_state, want.last_hidden_state
    assert hidden.shape == expected.shape
    assert relative_error(hidden[real], expected[real]) <= TOLERANCE
    assert torch.count_nonzero(hidden[~real]) == 0
    if want.pooler_output is None:
        assert got.pooler_output is None
    else:
        assert got.pooler_output.shape == want.pooler_output.shape
        assert relative_error(got.pooler_output, want.pooler_output) <= TOLERANCE


def check(graphed: Any, model: torch.nn.Module, grids: Grids, patches: int | None = None) -> None:
    """One call of ``grids`` through ``graphed`` against ``model`` itself."""
    inputs = call(grids, patches)
    with torch.inference_mode():
        got = graphed(**inputs)
        with graphed.original():
            want = model(**inputs)
    assert_equal_outputs(got, want, inputs)


@pytest.mark.usefixtures("registry")
def test_a_stream_of_mixed_grids_is_served_by_few_budgets() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32, max_tokens=128
    )
    assert isinstance(graphed.plan, siglip2.Siglip2Plan)  # adapter="auto" found it
    stream = [
        [(1, 1)],  # one patch
        [(3, 5), (7, 2)],
        [(1, 24), (24, 1), (2, 2)],  # far from square
        [(6, 6), (5, 3), (1, 1), (2, 9)],
        [(8, 8)],  # larger than the 4x4 table in both sides
        [(3, 3), (4, 2)],
    ]
    for grids in stream:
        check(graphed, model, grids, patches=70)
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.replays == len(stream)
    assert sorted(key.batch for key in graphed.keys) == [32, 64, 96]


@pytest.mark.usefixtures("registry")
def test_equal_token_totals_with_other_grids_read_their_own_boundaries_and_positions() -> None:
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), batch_sizes=[64])
    for grids in (
        [(3, 5), (7, 2), (5, 5)],  # 54 tokens
        [(5, 3), (2, 7), (5, 5)],  # the same counts, grids transposed
        [(6, 9)],
        [(1, 54)],
        [(5, 5), (1, 15), (14, 1)],
    ):
        check(graphed, model, grids)
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 5
    assert graphed.stats.served == {(54, "padded to 64"): 5}
    assert "  54 tokens: padded to 64 x5" in str(graphed.stats)  # a packed call's size is tokens


@pytest.mark.usefixtures("registry")
def test_replayed_outputs_are_the_callers_own_and_a_later_replay_leaves_them() -> None:
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), batch_sizes=[64])
    first_inputs, second_inputs = call([(3, 5), (7, 2)]), call([(6, 9)])
    with torch.inference_mode():
        first = graphed(**first_inputs)
        kept = [first.last_hidden_state.clone(), first.pooler_output.clone()]
        second = graphed(**second_inputs)
        with graphed.original():
            want = model(**second_inputs)
    (info,) = graphed.graphs
    owned = {t.untyped_storage().data_ptr() for t in info.outputs if torch.is_tensor(t)}
    for output in (first, second):
        for tensor in (output.last_hidden_state, output.pooler_output):
            assert tensor.untyped_storage().data_ptr() not in owned
    assert torch.equal(first.last_hidden_state, kept[0])
    assert torch.equal(first.pooler_output, kept[1])
    assert_equal_outputs(second, want, second_inputs)


@pytest.mark.usefixtures("registry")
def test_the_dense_backend_attends_under_the_block_mask_of_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dense backend (on a GPU only; here allowed by decree) attends over the whole budget
    under the block mask its prepare writes from each call's boundaries: other packings of the
    same budget, and its padding, stay apart."""
    monkeypatch.setattr(DenseMaskedAttention, "unavailable_reason", lambda *args: None)
    model = tower()
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        backend=SimulatedGraphs(),
        batch_sizes=[64],
        attention="sdpa_dense_masked",
    )
    for grids in ([(3, 5), (7, 2), (5, 5)], [(6, 9)], [(5, 5), (1, 15), (14, 1)], [(2, 2)]):
        check(graphed, model, grids)
    assert graphed.plan.attention_by_budget == {64: "sdpa_dense_masked"}
    assert graphed.stats.replays == 4


def test_the_block_mask_keeps_each_image_and_the_padding_apart() -> None:
    mask = block_mask(torch.tensor([0, 2, 5, 5], dtype=torch.int32), torch.arange(7), torch.float32)
    image = torch.tensor([0, 0, 1, 1, 1, 2, 2])  # tokens 5 and 6 are padding
    assert mask.shape == (1, 1, 7, 7)
    assert torch.equal(mask[0, 0] == 0, image[:, None] == image[None, :])
    assert torch.isneginf(mask[0, 0][image[:, None] != image[None, :]]).all()


@pytest.mark.usefixtures("registry")
def test_the_dense_backend_runs_only_on_a_gpu_and_auto_takes_it_only_where_timed() -> None:
    model = tower()
    for attention in ("auto", "sdpa_varlen"):
        graphed = layergraph.wrap(
            model, observe_calls=0, backend=SimulatedGraphs(), batch_sizes=[64], attention=attention
        )
        check(graphed, model, [(6, 9)])
        assert graphed.plan.attention_by_budget == {64: "sdpa_varlen"}
        graphed.unwrap()
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        backend=SimulatedGraphs(),
        batch_sizes=[64],
        attention="sdpa_dense_masked",
    )
    with torch.inference_mode(), pytest.raises(RuntimeError, match="runs on a GPU"):
        graphed(**call([(6, 9)]))


@pytest.mark.usefixtures("registry")
def test_a_position_table_updated_in_place_reaches_the_next_replay() -> None:
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), batch_sizes=[64])
    check(graphed, model, [(3, 5), (7, 2)])
    table = model.embeddings.position_embedding.weight
    model.load_state_dict(
        {"embeddings.position_embedding.weight": torch.randn_like(table)}, strict=False
    )
    check(graphed, model, [(3, 5), (7, 2)])
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 2


@pytest.mark.usefixtures("registry")
def test_calls_above_every_budget_are_split_by_images_an_image_above_them_eagerly() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, backend=SimulatedGraphs(), batch_sizes=[32, 64]
    )
    check(graphed, model, [(6, 6), (4, 7), (2, 5), (5, 5)])  # 99 tokens: 64 + 35
    assert graphed.stats.split_calls == 1
    assert graphed.stats.served[(99, "split into 2 calls")] == 1
    check(graphed, model, [(2, 3), (9, 8), (1, 1)])  # 6 | an image of 72 tokens | 1
    assert graphed.stats.split_calls == 2
    assert graphed.stats.served[(79, "split into 3 calls, 1 eager")] == 1
    check(graphed, model, [(9, 8)])  # that image alone
    assert graphed.stats.eager_calls == {
        "an image of this call is above the largest token budget (64): it ran eagerly, "
        "the rest from graphs": 1,
        "an image of this call is above the largest token budget (64)": 1,
    }


@pytest.mark.usefixtures("registry")
def test_the_eager_path_and_validation_hold_zeros_at_the_padding_too() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32, validate=True
    )
    inputs = call([(3, 5), (2, 2)], patches=20)
    with torch.inference_mode():
        replayed = graphed(**inputs)  # validated against the eager path: no mismatch
        eager = graphed(**inputs, output_hidden_states=True)
        with graphed.original():
            want = model(**inputs, output_hidden_states=True)
    assert graphed.stats.eager_calls == {
        "hidden states were asked for (output_hidden_states=True)": 1
    }
    assert_equal_outputs(replayed, want, inputs)
    assert_equal_outputs(eager, want, inputs)
    assert len(eager.hidden_states) == len(want.hidden_states) == 4


def shift_first_mask(mask: torch.Tensor) -> None:
    mask[0] = mask[0].roll(1)


def unmask_second_padding(mask: torch.Tensor) -> None:
    mask[1] = 1


@pytest.mark.parametrize("change", [shift_first_mask, unmask_second_padding])
@pytest.mark.usefixtures("registry")
def test_a_mask_unlike_the_grids_runs_eagerly_with_the_reason(change: Any) -> None:
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs())
    inputs = call([(3, 5), (2, 2)], patches=20)
    change(inputs["pixel_attention_mask"])
    with torch.inference_mode():
        got = graphed(**inputs)
        with graphed.original():
            want = model(**inputs)
    assert list(graphed.stats.eager_calls) == [
        "input pixel_attention_mask does not mark exactly the first height x width patches of "
        "each image (spatial_shapes) as real"
    ]
    assert graphed.stats.graphs == 0
    assert_equal_outputs(got, want, inputs)


@pytest.mark.usefixtures("registry")
def test_a_call_without_mask_runs_the_tower_eagerly_with_the_reason() -> None:
    model = tower()
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs())
    inputs = dict(call([(3, 5), (5, 3)]), pixel_attention_mask=None)
    with torch.inference_mode():
        got = graphed(**inputs)
        with graphed.original():
            want = model(**inputs)
    assert graphed.stats.eager_calls == {
        "the graphs need pixel_values, pixel_attention_mask and spatial_shapes as tensors": 1
    }
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        (
            dict(call([(3, 5)], patches=20), spatial_shapes=torch.tensor([[5, 5]])),
            r"input spatial_shapes row 0 \(5x5\): sides must be positive and hold at most the "
            r"20 patches",
        ),
        (
            dict(call([(2, 2)]), pixel_values=torch.randn(1, 4, FEATURES + 1)),
            r"input pixel_values \(1, 4, 13\), pixel_attention_mask \(1, 4\) and spatial_shapes "
            r"\(1, 2\) are not \[images, patches, 12\]",
        ),
    ],
)
@pytest.mark.usefixtures("registry")
def test_inputs_the_tower_cannot_take_get_the_reason_and_the_towers_error(
    inputs: dict[str, torch.Tensor], reason: str
) -> None:
    graphed = layergraph.wrap(tower(), observe_calls=0, backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=f"{reason}.*the model raised"):
        graphed(**inputs)
    assert graphed.stats.graphs == 0


@pytest.mark.usefixtures("registry")
def test_a_tower_without_head_and_tuple_outputs() -> None:
    model = tower(vision_use_head=False)
    graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
    inputs = call([(4, 4), (1, 7)], patches=18)
    with torch.inference_mode():
        got = graphed(**inputs, return_dict=False)
        with graphed.original():
            want = model(**inputs, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) == 1
    real = inputs["pixel_attention_mask"].bool()
    assert relative_error(got[0][real], want[0][real]) <= TOLERANCE
    assert torch.count_nonzero(got[0][~real]) == 0
    assert graphed.stats.replays == 1


@pytest.mark.usefixtures("registry", "runnable_triton")
def test_the_triton_kernel_reads_the_budgets_boundaries() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, attention="triton", backend=SimulatedGraphs(), batch_sizes=[64]
    )
    for grids in ([(3, 5), (7, 2), (1, 1)], [(1, 30), (5, 6)]):
        check(graphed, model, grids)
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 2


class UnwrittenPadding(SdpaMaskedAttention):
    """``sdpa_varlen`` as a kernel that reads and writes only the real sequences, into fresh
    memory (FA3): rows past the last boundary are never read, and come out NaN."""

    name = "unwritten_padding"

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        # rows past the last boundary, found on the device as a kernel would (no host read)
        rows = torch.arange(q.shape[0], device=q.device) < kwargs["metadata"].cu_seqlens[-1]
        real = rows.view(-1, *([1] * (q.dim() - 1)))
        q, k, v = (torch.where(real, t, torch.zeros_like(t)) for t in (q, k, v))
        out = super().__call__(q, k, v, **kwargs)
        return torch.where(real, out, torch.full_like(out, float("nan")))


def test_unwritten_attention_rows_of_the_padding_reach_no_pooled_feature(registry: Any) -> None:
    class Plugin:
        @layergraph.hookimpl
        def register_attention_backends(self, register: Any) -> None:
            register(UnwrittenPadding())

    registry.add_plugin(Plugin(), "unwritten-padding")
    model = tower()
    graphed = layergraph.wrap(
        model,
        observe_calls=0,
        attention="unwritten_padding",
        backend=SimulatedGraphs(),
        batch_sizes=[64],
    )
    for grids in ([(3, 5), (7, 2)], [(6, 6), (1, 1), (2, 2)]):
        check(graphed, model, grids)
    assert graphed.stats.replays == 2


def test_a_plugins_metadata_for_the_budget_holds_each_calls_boundaries(registry: Any) -> None:
    plugin = RecordingPlugin()
    registry.add_plugin(plugin, "recording-plugin")
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, attention="recording", backend=SimulatedGraphs(), batch_sizes=[64]
    )
    for grids, boundaries in (
        ([(3, 5), (7, 2)], [0, 15, 29, *[29] * 6]),
        ([(2, 7), (5, 3), (1, 1)], [0, 14, 29, 30, *[30] * 5]),
    ):
        plugin.backend.scrub()
        check(graphed, model, grids)
        assert plugin.backend.seen  # every layer's attention, in the replay
        assert all(metadata is plugin.built[0] for metadata, _ in plugin.backend.seen)
        assert all(seen.tolist() == boundaries for _, seen in plugin.backend.seen)
    assert plugin.asked == [PackedLayout(64, 8, 64)]


@pytest.mark.usefixtures("registry")
def test_siglip2_models_image_features_and_classification_go_through_the_graphs() -> None:
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.Siglip2Config(text_config=text, vision_config=VISION, num_labels=3)
    classifier = sharpen(transformers.Siglip2ForImageClassification(config).eval())
    dual = sharpen(transformers.Siglip2Model(config).eval())
    for model in (classifier, dual):
        assert siglip2.Siglip2Adapter().recognizes(model)
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        inputs = call([(3, 5), (6, 2), (2, 2)], patches=16)
        with torch.inference_mode():
            if model is dual:
                got = model.get_image_features(**inputs).pooler_output
                with graphed.original():
                    want = model.get_image_features(**inputs).pooler_output
            else:
                got = graphed(**inputs).logits
                with graphed.original():
                    want = model(**inputs).logits
        assert relative_error(got, want) <= TOLERANCE
        assert graphed.stats.replays == 1
        assert graphed.stats.eager_total == 0
        assert graphed.unwrap() is model
        assert "forward" not in model.vision_model.__dict__


@pytest.mark.usefixtures("registry")
def test_lfm2_vl_image_features_and_generate_read_the_graphs() -> None:
    model = lfm2_vl()
    assert siglip2.Siglip2Adapter().recognizes(model)
    assert siglip2.Siglip2Adapter().recognizes(model.model)  # the tower at vision_tower
    grids = [(4, 6), (2, 2)]  # 2x3 and 1x1 image tokens after the 2x2 unshuffle
    inputs = call(grids, patches=30)
    prompt = torch.tensor([[1, *[IMAGE_TOKEN] * 6, 2, IMAGE_TOKEN, 3]])
    with torch.inference_mode():
        features = model.model.get_image_features(**inputs).pooler_output
        logits = model(input_ids=prompt, **inputs).logits
        tokens = model.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        got = model.model.get_image_features(**inputs).pooler_output
        assert [t.shape for t in got] == [t.shape for t in features] == [(6, 32), (1, 32)]
        for part, expected in zip(got, features):
            assert relative_error(part, expected) <= TOLERANCE
        assert relative_error(graphed(input_ids=prompt, **inputs).logits, logits) <= TOLERANCE
        generated = graphed.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, tokens)
    assert graphed.stats.replays == 3  # get_image_features, forward, generate's prefill
    assert graphed.stats.eager_total == 0
    assert graphed.unwrap() is model
    assert "forward" not in model.model.vision_tower.__dict__


@pytest.mark.usefixtures("registry")
def test_lfm2_vl_reads_its_image_processors_tiles_and_thumbnails_from_the_graphs() -> None:
    """Calls as LFM2-VL's image processor makes them (at this tower's 2-pixel patches): photos
    above 16 image tokens cut into tiles of 8x8 patches with a thumbnail, smaller ones resized
    whole, every image padded to 64 patches. The VLM reads the real patches of each image
    (pixel-unshuffled 2x2 and projected outside the graphs)."""
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    processor = Lfm2VlImageProcessor(
        encoder_patch_size=PATCH, tile_size=16, min_image_tokens=4, max_image_tokens=16
    )
    model = lfm2_vl()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), observe_calls=0, budget_step=32)
    generator = torch.Generator().manual_seed(0)
    calls = ([(20, 15)], [(60, 34), (6, 40)], [(16, 16), (40, 30), (90, 20)])
    encoded = 0
    for photos in calls:
        images = [
            torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)
            for width, height in photos
        ]
        inputs = dict(processor(images, return_tensors="pt"))
        encoded += inputs["pixel_values"].shape[0]
        with torch.inference_mode():
            got = model.get_image_features(**inputs).pooler_output
            with graphed.original():
                want = model.get_image_features(**inputs).pooler_output
        assert [t.shape for t in got] == [t.shape for t in want]
        assert sum(t.shape[0] for t in got) == int(inputs["pixel_attention_mask"].sum()) // 4
        for part, expected in zip(got, want):
            assert relative_error(part, expected) <= TOLERANCE
    assert encoded > sum(map(len, calls))  # some photos became tiles and thumbnails
    assert graphed.stats.replays == len(calls)
    assert graphed.stats.eager_total == 0, dict(graphed.stats.eager_calls)


@pytest.mark.usefixtures("registry")
def test_unwrap_gives_back_the_towers_own_forward_and_attention() -> None:
    model = tower()
    inputs = call([(3, 5), (2, 2)])
    with torch.inference_mode():
        before = model(**inputs)
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs())
        graphed(**inputs)
        assert graphed.unwrap() is model
        after = model(**inputs)
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert torch.equal(before.last_hidden_state, after.last_hidden_state)


@pytest.mark.usefixtures("registry")
def test_options_the_adapter_cannot_serve_are_refused_at_wrap() -> None:
    model = tower()
    with pytest.raises(ValueError, match="attention='sdpa': choose one of sdpa_varlen"):
        layergraph.wrap(
            model, observe_calls=0, adapter="siglip2", attention="sdpa", backend=SimulatedGraphs()
        )
    with pytest.raises(ValueError, match="max_tokens 1000 must be a multiple of budget_step 256"):
        layergraph.wrap(
            model, observe_calls=0, adapter="siglip2", max_tokens=1000, backend=SimulatedGraphs()
        )
    with pytest.raises(AdapterMismatch, match="the siglip2 adapter serves transformers'"):
        layergraph.wrap(
            torch.nn.Linear(2, 2), observe_calls=0, adapter="siglip2", backend=SimulatedGraphs()
        )
    assert "forward" not in model.__dict__


@pytest.mark.usefixtures("registry")
def test_releases_outside_the_checked_range_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.5.4")
    model = tower()
    with pytest.raises(AdapterMismatch, match="siglip2 adapter was checked with transformers"):
        layergraph.wrap(model, observe_calls=0, adapter="siglip2", backend=SimulatedGraphs())
    assert "forward" not in model.__dict__
