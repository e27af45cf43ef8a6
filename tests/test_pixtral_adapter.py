"""The pixtral adapter: Pixtral vision towers served per token budget, alone and inside VLMs.

On the CPU through simulated graphs: every answer must equal the unwrapped tower's on fresh
random inputs within 1e-4 relative error (float32; about 1e-7 is seen), in
``last_hidden_state`` and in every hidden state the call selects. Images are padded with random
pixels, not zeros, so that padding reaching a real patch shows. The towers' attention is
sharpened (:func:`sharpen`): wrong boundaries or positions give errors far above the tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packed_helpers import RecordingPlugin

import layergraph
from layergraph import AdapterMismatch
from layergraph.staging import Staging
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.feature_outputs import ON_DEMAND_REASON
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE
from layergraph_adapters.pixtral import PIXTRAL_SUPPORT

transformers = pytest.importorskip("transformers")
pixtral = pytest.importorskip("layergraph_adapters.pixtral")
if not hasattr(transformers, "PixtralVisionModel"):
    pytest.skip("this transformers has no PixtralVisionModel", allow_module_level=True)

SELECTS_BY_INDEX = hasattr(
    importlib.import_module("transformers.utils.output_capturing"), "selected_hidden_states"
)
"""Whether the installed transformers selects hidden states by index (5.24) or takes any true
``output_hidden_states`` for all of them and a list for layer outputs (5.17)."""
TOLERANCE = 1e-4
PATCH = 2
VISION = dict(
    model_type="pixtral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,  # head_dim 16: the Triton kernel's smallest
    patch_size=PATCH,
    image_size=32,
)
MISTRAL = dict(
    model_type="mistral",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=128,
)

IMAGE_TOKEN = 100
Sizes = list[tuple[int, int]]
"""Each image's (height, width) in pixels."""


@pytest.fixture
def registry(layergraph_registry: Any) -> Any:
    """The registry with the pixtral plugin: from the entry points where this checkout is
    installed, added here where an older install's entry points lack it."""
    if not layergraph_registry.plugin_manager.is_registered(pixtral):
        layergraph_registry.add_plugin(pixtral, "pixtral")
    return layergraph_registry


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision attention's q and k weights drawn at scale 1: at the init scale
    attention is nearly flat, and patches of other images attended to would change the outputs
    by little."""
    for module in model.modules():
        if type(module).__name__ == "PixtralAttention":
            torch.nn.init.normal_(module.q_proj.weight, std=1.0)
            torch.nn.init.normal_(module.k_proj.weight, std=1.0)
    return model


def skip_outside_the_served_releases() -> None:
    """Skip the calling test where the installed transformers is outside the releases the
    pixtral adapter is served with (other test modules build these models too)."""
    served = SpecifierSet(PIXTRAL_SUPPORT.checked).contains(
        transformers.__version__, prereleases=True
    )
    if not served and os.environ.get(UNCHECKED_VARIABLE) != "1":
        pytest.skip(f"the pixtral adapter is served with transformers{PIXTRAL_SUPPORT.checked}")


def tower(**settings: Any) -> torch.nn.Module:
    """A tiny ``PixtralVisionModel`` with random weights (``settings`` override
    :data:`VISION`)."""
    skip_outside_the_served_releases()
    torch.manual_seed(0)
    config = transformers.PixtralVisionConfig(**{**VISION, **settings})
    return sharpen(transformers.PixtralVisionModel(config).eval())


def vlm(family: str) -> torch.nn.Module:
    """A tiny VLM of ``family`` (``mistral3``, ``llava``, ``lighton_ocr``, ``mistral_large4``)
    whose tower is a tiny ``PixtralVisionModel``."""
    skip_outside_the_served_releases()
    torch.manual_seed(0)
    if family == "mistral3":
        config = transformers.Mistral3Config(
            vision_config=VISION, text_config=MISTRAL, image_token_index=IMAGE_TOKEN
        )
        model = transformers.Mistral3ForConditionalGeneration(config)
    elif family == "llava":
        config = transformers.LlavaConfig(
            vision_config=VISION,
            text_config=MISTRAL,
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-1,  # Pixtral-12B's
            vision_feature_select_strategy="full",
        )
        model = transformers.LlavaForConditionalGeneration(config)
    elif family == "lighton_ocr":
        text = dict(MISTRAL, model_type="qwen3")
        config = transformers.LightOnOcrConfig(
            vision_config=VISION, text_config=text, image_token_id=IMAGE_TOKEN
        )
        model = transformers.LightOnOcrForConditionalGeneration(config)
    else:
        if not hasattr(transformers, "MistralLarge4Config"):
            pytest.skip(f"transformers {transformers.__version__} has no Mistral Large 4")
        text = dict(
            MISTRAL,
            model_type="mistral_large4_text",
            moe_intermediate_size=16,
            num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            index_topk=16,
            index_head_dim=16,
            index_n_heads=2,
        )
        config = transformers.MistralLarge4Config(
            vision_config=VISION, text_config=text, image_token_index=IMAGE_TOKEN
        )
        model = transformers.MistralLarge4ForConditionalGeneration(config)
    return sharpen(model.eval())


def call(sizes: Sizes, padded: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Images of ``sizes`` (pixels) padded to ``padded`` (default: the largest sides), the
    padding random, with their ``image_sizes``."""
    height = padded[0] if padded else max(h for h, _ in sizes)
    width = padded[1] if padded else max(w for _, w in sizes)
    return dict(
        pixel_values=torch.randn(len(sizes), 3, height, width),
        image_sizes=torch.tensor(sizes),
    )


def assert_equal_outputs(got: Any, want: Any) -> None:
    """``got`` (the wrapped tower's) equals ``want`` (the tower's): the last hidden state and
    the hidden states selected, ``None`` where the tower's are."""
    assert type(got) is type(want)
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    if want.hidden_states is None:
        assert got.hidden_states is None
        return
    assert len(got.hidden_states) == len(want.hidden_states)
    for index, (have, expected) in enumerate(zip(got.hidden_states, want.hidden_states)):
        if expected is None:
            assert have is None, index
        else:
            assert relative_error(have, expected) <= TOLERANCE, index


def check(
    graphed: Any,
    model: torch.nn.Module,
    sizes: Sizes,
    padded: tuple[int, int] | None = None,
    **options: Any,
) -> None:
    """One call of images of ``sizes`` through ``graphed`` against ``model`` itself."""
    inputs = call(sizes, padded)
    with torch.inference_mode():
        got = graphed(**inputs, **options)
        with graphed.original():
            want = model(**inputs, **options)
    assert_equal_outputs(got, want)


@pytest.mark.usefixtures("registry")
def test_a_stream_of_mixed_sizes_is_served_by_few_budgets() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32, max_tokens=128
    )
    assert isinstance(graphed.plan, pixtral.PixtralPlan)  # adapter="auto" found it
    stream = [
        [(2, 2)],  # one patch
        [(6, 10), (14, 4)],
        [(2, 48), (48, 2), (4, 4)],  # far from square
        [(12, 12), (10, 6), (2, 2), (4, 18)],
        [(16, 16)],  # one image, its padded size
        [(7, 9), (5, 3)],  # sides that are not multiples of the patch
        [(2, 2)] * 12,  # more images than the eight slots of the first budgets
    ]
    for sizes in stream:
        check(graphed, model, sizes, padded=(48, 48))
    stats = graphed.stats
    assert stats.eager_total == 0, dict(stats.eager_calls)
    assert stats.replays == len(stream)
    assert sorted({key.batch for key in graphed.keys}) == [32, 64, 96]


@pytest.mark.usefixtures("registry")
def test_equal_token_totals_with_other_grids_read_their_own_boundaries_and_positions() -> None:
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[64])
    for sizes in (
        [(6, 10), (14, 4), (10, 10)],  # 54 patches
        [(10, 6), (4, 14), (10, 10)],  # the same counts, grids transposed
        [(12, 18)],
        [(2, 108)],
        [(10, 10), (2, 30), (28, 2)],
    ):
        check(graphed, model, sizes)
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 5
    assert graphed.stats.served == {(54, "padded to 64"): 5}


@pytest.mark.usefixtures("registry")
def test_a_call_of_the_grids_the_buffers_hold_sends_only_its_patches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends: list[None] = []
    send = Staging.send
    monkeypatch.setattr(Staging, "send", lambda staging: sends.append(None) or send(staging))
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[64])
    first, second = [(6, 10), (14, 4), (10, 10)], [(10, 6), (4, 14), (10, 10)]
    for sizes in (first, first, first, second, second, first):
        check(graphed, model, sizes)  # new random pixels each call
    assert graphed.stats.replays == 6 and graphed.stats.graphs == 1
    assert len(sends) == 3  # the capture's (first), then second, then first again


@pytest.mark.parametrize("selected", [True, -1, -2, 0, [0, -1], [1, 2], 7])
@pytest.mark.usefixtures("registry")
def test_the_hidden_states_a_call_selects_come_from_the_graphs(selected: Any) -> None:
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[64])
    check(graphed, model, [(6, 10), (14, 4)], output_hidden_states=selected)
    check(graphed, model, [(8, 8)], output_hidden_states=selected)
    if isinstance(selected, list) and not SELECTS_BY_INDEX:
        assert graphed.stats.replays == 0
        assert graphed.stats.eager_calls == {
            "output_hidden_states as a list of layers, which this transformers collects by "
            "layer output without the embeddings": 2
        }
    else:
        assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0


@pytest.mark.usefixtures("registry")
def test_tuple_outputs_and_image_sizes_given_otherwise() -> None:
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[64])
    inputs = call([(6, 10), (14, 4)])
    pixels, sizes = inputs["pixel_values"], inputs["image_sizes"]
    with torch.inference_mode():
        got = graphed(pixels, sizes, return_dict=False, output_hidden_states=-1)
        listed = graphed(pixels, image_sizes=sizes.tolist())
        unsized = graphed(pixel_values=pixels)  # every image its padded size: 2 x 35 patches
        with graphed.original():
            want = model(pixels, sizes, return_dict=False, output_hidden_states=-1)
            want_unsized = model(pixel_values=pixels)
    assert isinstance(got, tuple) and len(got) == len(want) == 2
    assert relative_error(got[0], want[0]) <= TOLERANCE
    assert torch.equal(got[1][-1], got[0])  # the last hidden state, tied as the tower ties it
    assert [state is None for state in got[1]] == [state is None for state in want[1]]
    for have, expected in zip(got[1][:-1], want[1][:-1]):
        assert expected is None or relative_error(have, expected) <= TOLERANCE
    assert relative_error(listed.last_hidden_state, want[0]) <= TOLERANCE
    assert_equal_outputs(unsized, want_unsized)
    assert graphed.stats.served == {
        (29, "padded to 64"): 2,
        (70, "split into 2 calls"): 1,
        (35, "padded to 64"): 2,  # its pieces
    }
    assert graphed.stats.eager_total == 0


@pytest.mark.usefixtures("registry")
def test_pixel_values_of_other_layouts_are_read_where_they_lie() -> None:
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[64])
    inputs = call([(6, 10), (14, 4)], padded=(16, 12))
    layouts = (
        inputs["pixel_values"].contiguous(memory_format=torch.channels_last),
        torch.randn(3, 2, 16, 12).transpose(0, 1),  # channels outermost in memory
    )
    for pixels in layouts:
        with torch.inference_mode():
            got = graphed(pixels, image_sizes=inputs["image_sizes"])
            with graphed.original():
                want = model(pixels, image_sizes=inputs["image_sizes"])
        assert_equal_outputs(got, want)
    assert graphed.stats.replays == 2


@pytest.mark.usefixtures("registry")
def test_calls_above_every_budget_are_split_by_images_an_image_above_them_eagerly() -> None:
    model = tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[32, 64])
    check(graphed, model, [(12, 12), (8, 14), (4, 10), (10, 10)], output_hidden_states=True)
    assert graphed.stats.split_calls == 1
    assert graphed.stats.served[(99, "split into 2 calls")] == 1
    check(graphed, model, [(4, 6), (18, 16), (2, 2)], output_hidden_states=-2)
    assert graphed.stats.split_calls == 2
    assert graphed.stats.served[(79, "split into 3 calls, 1 eager")] == 1
    check(graphed, model, [(18, 16)])  # that image alone
    assert graphed.stats.eager_calls == {
        "an image of this call is above the largest token budget (64): it ran eagerly, "
        "the rest from graphs": 1,
        "an image of this call is above the largest token budget (64)": 1,
    }


@pytest.mark.usefixtures("registry")
def test_attention_weights_asked_for_run_the_tower_eagerly_with_the_reason() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32, validate=True
    )
    inputs = call([(6, 10), (4, 4)])
    with torch.inference_mode():
        replayed = graphed(**inputs)  # validated against the eager path: no mismatch
        eager = graphed(**inputs, output_attentions=True)
        with graphed.original():
            want = model(**inputs, output_attentions=True)
    assert graphed.stats.eager_calls == {
        "attention weights were asked for (output_attentions=True)": 1
    }
    assert relative_error(replayed.last_hidden_state, want.last_hidden_state) <= TOLERANCE
    assert torch.equal(eager.last_hidden_state, want.last_hidden_state)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            dict(call([(6, 10), (4, 4)]), image_sizes=torch.tensor([[6, 10]])),
            r"image_sizes \(1, 2\) does not give a \(height, width\) for each of the 2 images "
            r"of pixel_values \(2, 3, 6, 10\)",
        ),
        (
            dict(call([(6, 10), (4, 4)]), image_sizes=torch.tensor([[6, 10], [8, 4]])),
            r"image_sizes row 1 \(8x4\) does not fit the images of pixel_values \(6x10 pixels\)",
        ),
        (
            dict(call([(6, 10), (4, 4)]), image_sizes=[(6, 10), (1, 4)]),
            r"image_sizes row 1 \(1x4\) .* with at least one 2x2 patch a side",
        ),
        (
            dict(call([(6, 10)]), image_sizes=[(6, 10, 3)]),
            r"image_sizes \(1, 3\) does not give a \(height, width\)",
        ),
        (dict(call([(6, 10)]), image_sizes=[(6,), (2, 2)]), "image_sizes is not a list"),
    ],
)
@pytest.mark.usefixtures("registry")
def test_image_sizes_unlike_pixel_values_raise_naming_what_is_wrong(
    inputs: dict[str, Any], message: str
) -> None:
    graphed = layergraph.wrap(tower(), backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        graphed(**inputs)
    assert graphed.stats.graphs == 0


@pytest.mark.usefixtures("registry")
def test_pixel_values_the_graphs_cannot_take_run_the_tower_with_the_reason() -> None:
    graphed = layergraph.wrap(tower(), backend=SimulatedGraphs())
    pixels = torch.randn(2, 4, 8, 8)  # four channels, the tower takes three
    with torch.inference_mode(), pytest.raises(ValueError, match="the model raised"):
        graphed(pixel_values=pixels, image_sizes=torch.tensor([[8, 8], [8, 8]]))
    assert graphed.stats.eager_calls == {
        "input pixel_values (2, 4, 8, 8) is not [images, 3, height, width]": 1
    }


@pytest.mark.usefixtures("registry", "runnable_triton")
def test_the_triton_kernel_reads_the_budgets_boundaries() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, attention="triton", backend=SimulatedGraphs(), batch_sizes=[64]
    )
    for sizes in ([(6, 10), (14, 4), (2, 2)], [(2, 60), (10, 12)]):
        check(graphed, model, sizes)
    assert graphed.stats.graphs == 1
    assert graphed.stats.replays == 2
    assert graphed.plan.attention_by_budget == {64: "triton"}


def test_a_plugins_metadata_for_the_budget_holds_each_calls_boundaries(registry: Any) -> None:
    plugin = RecordingPlugin(seq_lens=True)
    registry.add_plugin(plugin, "recording-plugin")
    model = tower()
    graphed = layergraph.wrap(
        model, attention="recording", backend=SimulatedGraphs(), batch_sizes=[64]
    )
    for sizes, boundaries in (
        ([(6, 10), (14, 4)], [0, 15, 29, *[29] * 6]),
        ([(4, 14), (10, 6), (2, 2)], [0, 14, 29, 30, *[30] * 5]),
    ):
        plugin.backend.scrub()
        check(graphed, model, sizes)
        assert plugin.backend.seen  # every layer's attention, in the replay
        assert all(metadata is plugin.built[0] for metadata, _ in plugin.backend.seen)
        assert all(seen.tolist() == boundaries for _, seen in plugin.backend.seen)
        lengths = torch.tensor(boundaries).diff().tolist()
        assert plugin.built[0].seq_lens.tolist() == lengths
    assert len(plugin.built) == 1


@pytest.mark.parametrize("family", ["mistral3", "llava", "lighton_ocr", "mistral_large4"])
@pytest.mark.usefixtures("registry")
def test_a_vlms_image_features_read_the_graphs(family: str) -> None:
    model = vlm(family)
    assert pixtral.PixtralAdapter().recognizes(model)
    assert pixtral.PixtralAdapter().recognizes(model.model)
    inputs = call([(8, 12), (4, 4), (12, 4)])
    with torch.inference_mode():
        want = model.model.get_image_features(**inputs).pooler_output
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        got = model.get_image_features(**inputs).pooler_output
    assert graphed.adapter.name == "pixtral"
    assert [t.shape for t in got] == [t.shape for t in want]
    for part, expected in zip(got, want):
        assert relative_error(part, expected) <= TOLERANCE
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0
    assert graphed.unwrap() is model
    assert all("forward" not in module.__dict__ for module in model.modules())


@pytest.mark.parametrize(("family", "read"), [("mistral3", -1), ("llava", -2)])
@pytest.mark.usefixtures("registry")
def test_a_vlms_graph_keeps_the_hidden_states_it_reads_and_computes_others_on_demand(
    family: str, read: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = vlm(family)
    model.config.vision_feature_layer = read
    tower = model.model.vision_tower
    inputs = call([(8, 12), (4, 4), (12, 4)])
    with torch.inference_mode():
        want = tower(**inputs, output_hidden_states=True)
        features = model.model.get_image_features(**inputs).pooler_output
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        got = model.model.get_image_features(**inputs).pooler_output
        for part, expected in zip(got, features):
            assert relative_error(part, expected) <= TOLERANCE
        # The VLM's call (True with transformers 5.17, its index with 5.24) keeps the last
        # hidden state and the one read.
        (entry,) = graphed.graphs
        assert len(entry.outputs) == (1 if read == -1 else 2)
        tower(**inputs, output_hidden_states=True)  # with 5.24, a graph of every hidden state
        reruns: list[None] = []
        forward = graphed.plan.own
        monkeypatch.setattr(
            graphed.plan, "own", lambda *a, **k: reruns.append(None) or forward(*a, **k)
        )
        out = tower(**inputs, output_hidden_states=True)
        assert isinstance(out, type(want))
        assert relative_error(out.last_hidden_state, want.last_hidden_state) <= TOLERANCE
        assert relative_error(out.hidden_states[read], want.hidden_states[read]) <= TOLERANCE
        assert reruns == []
        # Every hidden state read: those the graph left out come from one eager forward.
        assert len(out.hidden_states) == len(want.hidden_states)
        for have, expected in zip(out.hidden_states, want.hidden_states):
            assert relative_error(have, expected) <= TOLERANCE
        assert len(reruns) == (0 if SELECTS_BY_INDEX else 1)
    # The forward run for the hidden states the graph left out is counted (transformers 5.17).
    assert graphed.stats.eager_calls == ({ON_DEMAND_REASON: 1} if reruns else {})


@pytest.mark.usefixtures("registry")
def test_a_tower_given_its_feature_layers_keeps_those_alone_for_a_call_asking_for_all() -> None:
    model = tower()
    inputs = call([(8, 12), (4, 4)])
    with torch.inference_mode():
        want = model(**inputs, output_hidden_states=True)
        graphed = layergraph.wrap(
            model, adapter="pixtral", feature_layers=-2, batch_sizes=[64], backend=SimulatedGraphs()
        )
        out = graphed(**inputs, output_hidden_states=True)
    (entry,) = graphed.graphs
    # The last hidden state, and the hidden states kept besides it: with 5.24, True asks for
    # every one by itself.
    kept = 2 if not SELECTS_BY_INDEX else len(want.hidden_states)
    assert len(entry.outputs) == kept
    for have, expected in zip(out.hidden_states, want.hidden_states, strict=True):
        assert relative_error(have, expected) <= TOLERANCE


@pytest.mark.usefixtures("registry")
def test_a_vlms_call_split_around_an_image_above_every_budget_joins_what_it_reads() -> None:
    model = vlm("mistral3")
    model.config.vision_feature_layer = -2
    tower = model.model.vision_tower
    inputs = call([(18, 16), (4, 6), (2, 2)])  # the first image above every budget
    with torch.inference_mode():
        want = tower(**inputs, output_hidden_states=True)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(), batch_sizes=[32, 64])
        out = tower(**inputs, output_hidden_states=True)
        assert graphed.stats.served[(79, "split into 2 calls, 1 eager")] == 1
        assert relative_error(out.last_hidden_state, want.last_hidden_state) <= TOLERANCE
        for have, expected in zip(out.hidden_states, want.hidden_states, strict=True):
            assert relative_error(have, expected) <= TOLERANCE


@pytest.mark.usefixtures("registry")
def test_mistral3_generate_reads_the_graphs() -> None:
    model = vlm("mistral3")
    inputs = call([(8, 12), (4, 4)])  # 2x3 and 1x1 image tokens after the 2x2 patch merger
    prompt = torch.tensor([[1, *[IMAGE_TOKEN] * 6, 2, IMAGE_TOKEN, 3]])
    with torch.inference_mode():
        logits = model(input_ids=prompt, **inputs).logits
        tokens = model.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs(), budget_step=32)
        assert relative_error(graphed(input_ids=prompt, **inputs).logits, logits) <= TOLERANCE
        generated = graphed.generate(input_ids=prompt, **inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, tokens)
    assert graphed.stats.replays == 2  # forward, generate's prefill
    assert graphed.stats.eager_total == 0


@pytest.mark.usefixtures("registry")
def test_unwrap_gives_back_the_towers_own_forward_and_attention() -> None:
    model = tower()
    inputs = call([(6, 10), (4, 4)])
    with torch.inference_mode():
        before = model(**inputs)
        graphed = layergraph.wrap(model, observe_calls=0, backend=SimulatedGraphs())
        graphed(**inputs)
        assert graphed.unwrap() is model
        after = model(**inputs)
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert torch.equal(before.last_hidden_state, after.last_hidden_state)


@pytest.mark.usefixtures("registry")
def test_other_models_holding_a_pixtral_tower_are_not_recognised() -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_tower = tower()

    assert not pixtral.PixtralAdapter().recognizes(Holder())
    assert pixtral.PixtralAdapter().recognizes(Holder().vision_tower)


@pytest.mark.usefixtures("registry")
def test_options_the_adapter_cannot_serve_are_refused_at_wrap() -> None:
    model = tower()
    with pytest.raises(ValueError, match="attention='sdpa': choose one of sdpa_varlen"):
        layergraph.wrap(model, adapter="pixtral", attention="sdpa", backend=SimulatedGraphs())
    with pytest.raises(ValueError, match="max_tokens 1000 must be a multiple of budget_step 16"):
        layergraph.wrap(model, adapter="pixtral", max_tokens=1000, backend=SimulatedGraphs())
    with pytest.raises(AdapterMismatch, match="the pixtral adapter serves transformers'"):
        layergraph.wrap(torch.nn.Linear(2, 2), adapter="pixtral", backend=SimulatedGraphs())
    with pytest.raises(ValueError, match=r"feature_layers \[-1, 9\]: hidden_states has 4 entries"):
        layergraph.wrap(model, adapter="pixtral", feature_layers=[-1, 9], backend=SimulatedGraphs())
    assert "forward" not in model.__dict__


@pytest.mark.usefixtures("registry")
def test_the_graphs_outputs_take_the_class_the_towers_own_forward_returns() -> None:
    @dataclasses.dataclass
    class TaggedOutput(transformers.modeling_outputs.BaseModelOutput):
        """An output class no annotation names."""

    class Tagged(transformers.PixtralVisionModel):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output = super().forward(*args, **kwargs)
            return TaggedOutput(**output) if kwargs.get("return_dict", True) else output

    model = tower()
    model.__class__ = Tagged
    graphed = layergraph.wrap(model, adapter="pixtral", observe_calls=0, backend=SimulatedGraphs())
    for sizes in ([(6, 10), (14, 4)], [(16, 16)]):
        inputs = call(sizes)
        with torch.inference_mode():
            got = graphed(**inputs)
            with graphed.original():
                want = model(**inputs)
        assert type(got) is TaggedOutput
        assert_equal_outputs(got, want)
    assert graphed.stats.eager_total == 0, dict(graphed.stats.eager_calls)


@pytest.mark.usefixtures("registry")
def test_releases_outside_the_checked_range_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)
    model = tower()
    layergraph.list_adapters()  # loading the plugins may put another transformers module object
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.1")
    with pytest.raises(AdapterMismatch, match="pixtral adapter was checked with transformers"):
        layergraph.wrap(model, adapter="pixtral", backend=SimulatedGraphs())
    assert "forward" not in model.__dict__
