"""No silent states: a wrapper used after ``unwrap()`` raises naming it, a second wrap of a
wrapped model is refused whatever its adapter, and a model in training mode or called with
gradients on warns once that its calls run eagerly."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import layergraph
from layergraph.serving.gate import EagerModeWarning
from layergraph.testing import SimulatedGraphs

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


def timm_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32).eval()


def stack() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    return layers.eval()


def siglip_tower() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    return transformers.SiglipVisionModel(config).eval()


MODELS = {
    "timm": (timm_vit, lambda: torch.randn(2, 3, 32, 32)),
    "sequential": (stack, lambda: torch.randn(2, 8)),
    "siglip": (siglip_tower, lambda: torch.randn(2, 3, 32, 32)),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_wrapper_used_after_unwrap_raises_naming_unwrap(kind: str) -> None:
    build, example = MODELS[kind]
    model = build()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    x = example()
    with torch.inference_mode():
        graphed(x)
    assert graphed.unwrap() is model and graphed.unwrapped
    for use in (
        lambda: graphed(x),
        lambda: graphed.capture(x),
        lambda: graphed.original().__enter__(),
    ):
        with pytest.raises(RuntimeError, match=r"was unwrapped \(unwrap\(\) undid"):
            use()
    assert graphed.unwrap() is model  # a second unwrap() returns the model again
    with torch.inference_mode():
        model(x)  # the model itself runs as it did


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_second_wrap_of_a_wrapped_model_is_refused_until_unwrapped(kind: str) -> None:
    build, _ = MODELS[kind]
    model = build()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with pytest.raises(TypeError, match=r"is wrapped already .*unwrap\(\) it before wrapping"):
        layergraph.wrap(model, backend=SimulatedGraphs())
    graphed.unwrap()
    again = layergraph.wrap(model, backend=SimulatedGraphs())
    assert again.adapter.name == graphed.adapter.name
    again.unwrap()


def test_a_dropped_wrapper_kept_only_by_a_reference_cycle_does_not_refuse_a_new_wrap() -> None:
    """A wrapper that is gone from the user's hands but not yet collected (a reference cycle,
    such as a stored exception's traceback) is not a live wrapper: wrapping again works."""
    model = stack()
    gc.disable()
    try:
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        graphed.cycle = [graphed]  # type: ignore[attr-defined]
        del graphed
        again = layergraph.wrap(model, backend=SimulatedGraphs())
    finally:
        gc.enable()
    with torch.inference_mode():
        x = torch.randn(2, 8)
        assert torch.equal(again(x), model(x))
    again.unwrap()


def test_a_model_in_training_mode_warns_once_that_calls_run_eagerly() -> None:
    model = stack().train()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with (
        pytest.warns(EagerModeWarning, match=r"Sequential is in training mode.*\.eval\(\)"),
        torch.inference_mode(),
    ):
        graphed(torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerModeWarning)
        with torch.inference_mode():
            graphed(torch.randn(2, 8))  # once per wrapper and cause
    assert graphed.stats.eager_calls == {"model is in training mode": 2}
    graphed.unwrap()


def test_calls_with_gradients_on_warn_once_and_inference_calls_do_not() -> None:
    graphed = layergraph.wrap(stack().eval(), backend=SimulatedGraphs())
    with pytest.warns(EagerModeWarning, match=r"called with gradients on.*inference_mode"):
        graphed(torch.randn(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerModeWarning)
        graphed(torch.randn(2, 8))
        with torch.inference_mode():
            graphed(torch.randn(2, 8))
    assert graphed.stats.replays == 1
    graphed.unwrap()


class NoGraphs(SimulatedGraphs):
    """A backend that, like a machine without CUDA, captures nothing."""

    def unavailable_reason(self) -> str | None:
        return "CUDA is not available"


def test_without_graphs_an_input_unlike_the_model_gets_the_same_clear_errors() -> None:
    graphed = layergraph.wrap(timm_vit(), backend=NoGraphs())
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"^input dtype torch.float64 differs from model"):
            graphed(torch.randn(1, 3, 32, 32, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"^image size 48x48 differs from the model's 32x32"):
            graphed(torch.randn(1, 3, 48, 48))
        with pytest.raises(ValueError, match="expected 3 channels, got 4"):
            graphed(torch.randn(1, 4, 32, 32))
        assert graphed(torch.randn(2, 3, 32, 32)).shape[0] == 2  # a right input runs
    assert graphed.stats.eager_calls["CUDA is not available"] == 3
    graphed.unwrap()
