"""Paths that once answered differently from the model, each checked against the unwrapped
model on the faithful simulated replay (:class:`layergraph.testing.SimulatedGraphs`).

Tiny random-weight transformers models (:mod:`tiny_models`), float32; tolerance 1e-4 relative
(the graphs run the same operators as eager, so differences are rounding).
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
from typing import Any

import pytest
import torch
from tiny_models import IMAGE, VLMS, seeded, transformers_attr, vision

import layergraph
from layergraph.testing import SimulatedGraphs


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def llava() -> Any:
    return VLMS["LlavaForConditionalGeneration"].build()


def test_fields_computed_on_read_come_from_the_inputs_of_the_call_not_a_refilled_buffer() -> None:
    model = llava()
    tower = model.model.vision_tower
    reference = copy.deepcopy(tower)
    graphed = layergraph.wrap(model, adapter="auto", backend=SimulatedGraphs())
    buffer = torch.empty(2, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        for _ in range(3):
            pixels = torch.randn(2, 3, IMAGE, IMAGE)
            buffer.copy_(pixels)
            out = tower(buffer, output_hidden_states=True)
            buffer.copy_(torch.randn(2, 3, IMAGE, IMAGE))  # the next batch, before reading
            want = reference(pixels, output_hidden_states=True)
            close(out.last_hidden_state, want.last_hidden_state)
            by_index = [out.hidden_states[i] for i in range(len(want.hidden_states))]
            for indexed, iterated, expected in zip(by_index, out.hidden_states, want.hidden_states):
                close(indexed, expected)
                assert torch.equal(indexed, iterated)
            close(out.to_tuple()[0], want.last_hidden_state)
    eager = graphed.stats.eager_calls
    assert graphed.stats.replays >= 2
    assert sum(count for reason, count in eager.items() if "left out" in reason) == 3


def whisper_encoder() -> Any:
    config = transformers_attr("WhisperConfig")(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_layers=1,
        decoder_attention_heads=4,
        num_mel_bins=16,
        max_source_positions=30,
    )
    return seeded(lambda: transformers_attr("whisper.WhisperEncoder")(config))


def test_hidden_states_collected_by_hooks_around_a_graphed_stack_run_eagerly() -> None:
    encoder = whisper_encoder()
    reference = copy.deepcopy(encoder)
    with torch.inference_mode():  # transformers installs its collecting hooks before wrap
        encoder(torch.randn(1, 16, 60), output_hidden_states=True)
    graphed = layergraph.wrap(
        encoder, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            features = torch.randn(2, 16, 60)
            out = graphed(features, output_hidden_states=True)
            want = reference(features, output_hidden_states=True)
            assert len(out.hidden_states) == len(want.hidden_states) == 3
            for got, expected in zip(out.hidden_states, want.hidden_states):
                close(got, expected)
            features = torch.randn(2, 16, 60)
            close(graphed(features).last_hidden_state, reference(features).last_hidden_state)
    reasons = graphed.stats.eager_calls
    assert sum(n for reason, n in reasons.items() if "collecting hidden_states" in reason) >= 2
    assert graphed.stats.replays >= 2  # the calls that collect nothing are served
    assert sum("collecting hidden_states" in str(w.message) for w in caught) == 1


def test_the_checking_call_of_a_layer_list_is_counted() -> None:
    encoder = whisper_encoder()
    graphed = layergraph.wrap(
        encoder, adapter="sequential", stack="layers", backend=SimulatedGraphs()
    )
    with torch.inference_mode():
        graphed(torch.randn(2, 16, 60))
    assert any("check how they are called" in reason for reason in graphed.stats.eager_calls)


def test_a_feature_layer_the_graphs_do_not_hold_is_named_with_the_fix() -> None:
    model = llava()
    graphed = layergraph.wrap(model, adapter="auto", backend=SimulatedGraphs())
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            graphed.get_image_features(
                pixel_values=torch.randn(1, 3, IMAGE, IMAGE), vision_feature_layer=-1
            )
    (reason,) = [r for r in graphed.stats.eager_calls if "feature layers" in r]
    assert "asked as -1" in reason and "wrap with feature_layers=[1, 2]" in reason
    assert sum("feature layers" in str(w.message) for w in caught) == 1


def test_a_refusal_names_the_part_that_is_served_and_advises_nothing_that_refuses() -> None:
    """A packed tower inside a model its adapter does not know is not served in place (the
    model may call it its own way): the refusal names the tower, which is served alone."""
    from test_qwen2_vl_adapter import call, tower

    class Retriever(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.visual = tower("qwen2_5_vl")

    model = Retriever().eval()
    with pytest.raises(layergraph.UnknownAdapterError) as refused:
        layergraph.wrap(model, backend=SimulatedGraphs())
    message = str(refused.value)
    assert "graphed = layergraph.wrap(model.visual)" in message
    assert "sequential" not in message.split("Adapters installed")[0]
    assert "adapter=" not in message
    reference = copy.deepcopy(model.visual)
    part = layergraph.wrap(model.visual, backend=SimulatedGraphs(), observe_calls=0)
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])
    with torch.inference_mode():
        close(
            part(pixels, grid_thw=grid).pooler_output,
            reference(pixels, grid_thw=grid).pooler_output,
        )
    assert part.stats.replays == 1


def clip_tower() -> Any:
    config = transformers_attr("CLIPVisionConfig")(
        **vision("CLIPVisionConfig")() | {"image_size": IMAGE}
    )
    return seeded(lambda: transformers_attr("CLIPVisionModel")(config))


def layergraph_marks(model: torch.nn.Module) -> list[str]:
    names = ("forward", "_apply", "__reduce_ex__")
    modules = model.named_modules()
    return [f"{path}.{name}" for path, m in modules for name in names if name in vars(m)]


def test_a_wrapped_model_pickles_and_copies_as_an_ordinary_model() -> None:
    model = clip_tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    pixels = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        served = graphed(pixels).pooler_output
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert layergraph_marks(copied) == [] and type(copied) is type(model)
            close(copied(pixels).pooler_output, served)
        assert graphed.stats.replays >= 1
    with pytest.raises(TypeError, match=r"graphed\.module"):
        copy.deepcopy(graphed)


def test_a_wrapper_dropped_without_unwrap_leaves_no_mark() -> None:
    model = clip_tower()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with torch.inference_mode():
        graphed(torch.randn(1, 3, IMAGE, IMAGE))
    assert layergraph_marks(model)
    del graphed
    gc.collect()
    assert layergraph_marks(model) == []
    pickle.dumps(model)
    layergraph.wrap(model, backend=SimulatedGraphs())  # not refused as wrapped already
