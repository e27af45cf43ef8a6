"""Plugin discovery through entry points, isolation of broken plugins, and adapter lookup."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import layergraph
from layergraph import plugins
from layergraph.plugins import AdapterRegistry, UnknownAdapterError

GOOD_PLUGIN = """
    import layergraph

    class ToyAdapter(layergraph.Adapter):
        name = "toy"

        def __init__(self, depth=1):
            self.depth = depth

        def plan(self, model):
            return layergraph.WholeForward(model)

    @layergraph.hookimpl
    def register_adapters(register):
        register(ToyAdapter)
"""


def by_name() -> dict[str, plugins.AdapterInfo]:
    return {info.name: info for info in layergraph.list_adapters()}


def test_first_party_adapters_come_from_installed_entry_points(fresh_registry: None) -> None:
    infos = by_name()
    for name in ("sequential", "timm"):
        assert infos[name].ok
        assert infos[name].distribution == "layergraph"
        assert infos[name].version == layergraph.__version__


def test_loading_plugins_does_not_import_model_frameworks(fresh_registry: None) -> None:
    import subprocess
    import sys

    code = (
        "import sys, layergraph; layergraph.list_adapters(); "
        "print(sorted(m for m in ('timm', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_third_party_plugin_is_found_and_used(installed_plugin: Callable[..., None]) -> None:
    installed_plugin("toyplugin", "toy", GOOD_PLUGIN)
    info = by_name()["toy"]
    assert (info.distribution, info.version, info.ok) == ("toyplugin", "1.2.3", True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).eval()
    graphed = layergraph.wrap(model, adapter="toy", depth=3)
    assert graphed.adapter.depth == 3


def test_broken_plugin_is_isolated_and_reported(installed_plugin: Callable[..., None]) -> None:
    installed_plugin("brokenplugin", "broken", "raise ImportError('missing dependency xyz')\n")
    infos = by_name()
    assert infos["timm"].ok and infos["sequential"].ok
    broken = infos["broken"]
    assert not broken.ok and broken.distribution == "brokenplugin"
    assert "ImportError: missing dependency xyz" in broken.error
    with pytest.raises(
        UnknownAdapterError, match=r"'broken' from brokenplugin 1\.2\.3 is unavailable"
    ):
        layergraph.wrap(torch.nn.Sequential(), adapter="broken")
    with pytest.raises(UnknownAdapterError, match=r"failed to load: broken \(brokenplugin\)"):
        layergraph.wrap(torch.nn.Sequential(), adapter="nosuch")


def test_hook_that_raises_marks_only_its_plugin_broken(
    installed_plugin: Callable[..., None],
) -> None:
    source = """
        import layergraph

        @layergraph.hookimpl
        def register_adapters(register):
            raise RuntimeError("registration failed")
    """
    installed_plugin("raisingplugin", "raising", source)
    infos = by_name()
    assert "RuntimeError: registration failed" in infos["raising"].error
    assert infos["timm"].ok


def test_misspelled_hook_fails_loudly_for_that_plugin(
    installed_plugin: Callable[..., None],
) -> None:
    source = """
        import layergraph

        @layergraph.hookimpl
        def register_adaptors(register):
            pass
    """
    installed_plugin("typoplugin", "typo", source)
    infos = by_name()
    assert "register_adaptors" in infos["typo"].error
    assert infos["sequential"].ok


def test_unknown_adapter_lists_available_names(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugins.DISABLE_ENV, "1")  # first-party adapters only
    with pytest.raises(
        UnknownAdapterError,
        match="no adapter named 'vit'; available: clip, internvl, sequential, siglip, timm",
    ):
        layergraph.wrap(torch.nn.Sequential(), adapter="vit")


def test_unknown_adapter_option_names_the_accepted_ones(fresh_registry: None) -> None:
    with pytest.raises(TypeError, match=r"does not take option\(s\) 'depth'; its options: stack"):
        layergraph.wrap(torch.nn.Sequential(), adapter="sequential", depth=2)


@pytest.mark.parametrize("setting", ["1", "all", "toyplugin", "toy"])
def test_environment_variable_turns_third_party_plugins_off(
    installed_plugin: Callable[..., None], monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    installed_plugin("toyplugin", "toy", GOOD_PLUGIN)
    monkeypatch.setenv(plugins.DISABLE_ENV, setting)
    infos = by_name()
    assert infos["toy"].error == f"disabled by {plugins.DISABLE_ENV}"
    assert infos["timm"].ok and infos["sequential"].ok


def test_duplicate_adapter_name_keeps_the_first(installed_plugin: Callable[..., None]) -> None:
    source = """
        import layergraph

        class Impostor(layergraph.Adapter):
            name = "timm"

        @layergraph.hookimpl
        def register_adapters(register):
            register(Impostor)
    """
    installed_plugin("impostor", "zz_impostor", source)
    registry = plugins.get_registry()
    assert registry.factory("timm").__module__ == "layergraph_adapters.timm_vit"
    failures = [info for info in registry.list() if info.distribution == "impostor"]
    assert failures and "already taken by layergraph" in failures[0].error


def test_local_plugin_can_be_added_and_removed() -> None:
    class Local(layergraph.Adapter):
        name = "local"

    class Plugin:
        @layergraph.hookimpl
        def register_adapters(self, register: Callable[..., None]) -> None:
            register(Local)

    registry = AdapterRegistry()
    registry.add_plugin(Plugin(), "local-plugin")
    assert registry.factory("local") is Local
    registry.remove_plugin("local-plugin")
    with pytest.raises(UnknownAdapterError):
        registry.factory("local")
