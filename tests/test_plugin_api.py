"""The plugin API evolves without breaking its authors: an adapter written for plugin API 1
(``plan(model)``) keeps working with a deprecation warning, layergraph's own adapters come
before other distributions' for ``adapter="auto"``, and an adapter whose ``plan`` fails is
passed over, with a warning naming it, for the next that recognises the model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import layergraph
from layergraph import LayergraphDeprecationWarning, plugins
from layergraph.adapter import PLUGIN_API_VERSION, plan_api_version
from layergraph.testing import SimulatedGraphs

transformers = pytest.importorskip("transformers")

OLD_VIT_PLUGIN = """
    import layergraph

    class OldViTAdapter(layergraph.Adapter):
        '''Written from the docs of layergraph 0.1: plan takes the model alone.'''

        name = "oldvit"

        def recognizes(self, model):
            return type(model).__name__ == "ViTModel"

        def plan(self, model):
            return layergraph.WholeForward(model)

    @layergraph.hookimpl
    def register_adapters(register):
        register(OldViTAdapter)
"""

FAILING_PLUGIN = """
    import layergraph
    import torch

    class FailingAdapter(layergraph.Adapter):
        name = "failing"

        def recognizes(self, model):
            return isinstance(model, {classes})

        def plan(self, model, context):
            return model.no_such_attribute

    @layergraph.hookimpl
    def register_adapters(register):
        register(FailingAdapter)
"""

FALLBACK_PLUGIN = """
    import layergraph

    class FallbackAdapter(layergraph.Adapter):
        name = "fallback"

        def recognizes(self, model):
            return isinstance(model, torch.nn.Sequential)

        def plan(self, model, context):
            return layergraph.WholeForward(model)

    import torch

    @layergraph.hookimpl
    def register_adapters(register):
        register(FallbackAdapter)
"""


def vit() -> torch.nn.Module:
    """A tiny transformers ViT with random weights."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    return transformers.ViTModel(config).eval()


def infos() -> dict[str, plugins.AdapterInfo]:
    return {info.name: info for info in layergraph.list_adapters()}


def test_the_api_version_of_an_adapter_is_read_from_its_plan() -> None:
    class Old(layergraph.Adapter):
        def plan(self, model):  # type: ignore[override]
            return layergraph.WholeForward(model)

    class Current(layergraph.Adapter):
        def plan(self, model, context):
            return layergraph.WholeForward(model)

    class Optional(layergraph.Adapter):
        def plan(self, model, context=None):
            return layergraph.WholeForward(model)

    assert PLUGIN_API_VERSION == 2 == layergraph.PLUGIN_API_VERSION
    assert plan_api_version(Old) == plan_api_version(Old()) == 1
    assert plan_api_version(Current) == plan_api_version(Current()) == 2
    assert plan_api_version(Optional) == 2
    assert plan_api_version(layergraph.SequentialAdapter) == 2


def test_an_old_api_plugin_beside_the_first_party_adapters_works_and_says_so(
    installed_plugin: Callable[..., None],
) -> None:
    installed_plugin("oldvitplugin", "oldvit", OLD_VIT_PLUGIN)
    model = vit()
    pixels = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        want = model(pixel_values=pixels).last_hidden_state
    # adapter="auto": the first-party vit adapter comes first, with no warning.
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "vit"
    graphed.unwrap()
    # Named, the old adapter serves, with a deprecation warning naming it and the way out.
    with pytest.warns(
        LayergraphDeprecationWarning, match=r"adapter 'oldvit' .*plan\(model\).*0\.3"
    ):
        graphed = layergraph.wrap(model, adapter="oldvit", backend=SimulatedGraphs())
    with torch.inference_mode():
        got = graphed(pixel_values=pixels).last_hidden_state
    assert torch.allclose(got, want, atol=1e-5)
    assert graphed.stats.replays == 1
    graphed.unwrap()
    listed = infos()["oldvit"]
    assert listed.ok and listed.distribution == "oldvitplugin"
    assert "plan(model) is plugin API 1" in listed.note


def test_a_plugin_whose_plan_fails_is_passed_over_for_the_next_adapter(
    installed_plugin: Callable[..., None],
) -> None:
    installed_plugin("failingplugin", "failing", FAILING_PLUGIN.format(classes="torch.nn.Module"))
    installed_plugin("fallbackplugin", "fallback", FALLBACK_PLUGIN)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    with pytest.warns(plugins.PluginFailureWarning) as warned:
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.adapter.name == "fallback"  # "failing" is asked first, and fails
    graphed.unwrap()
    message = str(warned[0].message)
    assert "'failing' (failingplugin 1.2.3)" in message and "AttributeError" in message
    assert "in plan()" in message and warned[0].filename == __file__
    failing = infos()["failing"]
    assert not failing.ok and "AttributeError" in failing.error
    assert "raised by plan()" in failing.error


def test_when_every_adapter_fails_the_first_failure_is_raised(
    installed_plugin: Callable[..., None],
) -> None:
    installed_plugin("failingplugin", "failing", FAILING_PLUGIN.format(classes="torch.nn.Linear"))
    with (
        pytest.warns(plugins.PluginFailureWarning),
        pytest.raises(AttributeError, match="no_such_attribute"),
    ):
        layergraph.wrap(torch.nn.Linear(2, 2), backend=SimulatedGraphs())


def test_an_adapter_mismatch_is_raised_not_passed_over(
    installed_plugin: Callable[..., None],
) -> None:
    refusing = FAILING_PLUGIN.format(classes="torch.nn.Sequential").replace(
        "return model.no_such_attribute",
        "raise layergraph.AdapterMismatch('this Sequential holds no layers to graph')",
    )
    installed_plugin("refusingplugin", "failing", refusing)
    with pytest.raises(layergraph.AdapterMismatch, match="holds no layers"):
        layergraph.wrap(torch.nn.Sequential(torch.nn.Linear(2, 2)), backend=SimulatedGraphs())
    assert infos()["failing"].ok
