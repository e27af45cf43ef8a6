"""Plugin discovery through entry points, isolation of broken plugins, and adapter lookup."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterator

import pytest
import torch

import layergraph
from layergraph import LayergraphDeprecationWarning, plugins
from layergraph.bench.examples import ExampleModel, example_model, example_model_names
from layergraph.plugins import AdapterRegistry, UnknownAdapterError

GOOD_PLUGIN = """
    import layergraph

    class ToyAdapter(layergraph.Adapter):
        name = "toy"

        def __init__(self, depth=1):
            self.depth = depth

        def plan(self, model, context=None):
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
    names = sorted(info.name for info in layergraph.list_adapters() if info.first_party)
    assert {"clip", "qwen2_vl", "sequential", "timm", "whisper"} <= set(names)
    with pytest.raises(
        UnknownAdapterError,
        match=re.escape(f"no adapter named 'swin'; available: {', '.join(names)}"),
    ):
        layergraph.wrap(torch.nn.Sequential(), adapter="swin")


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


def test_a_plugin_added_twice_is_refused_and_stays_registered() -> None:
    """Adding a plugin object that is registered already (from the entry points, say) must not
    take it out again: it raises, and its adapters stay."""

    class Twice(layergraph.Adapter):
        name = "twice"

    class Plugin:
        @layergraph.hookimpl
        def register_adapters(self, register: Callable[..., None]) -> None:
            register(Twice)

    plugin = Plugin()
    registry = AdapterRegistry()
    registry.add_plugin(plugin, "twice-plugin")
    with pytest.raises(ValueError, match="'again' is registered already \\(as 'twice-plugin'\\)"):
        registry.add_plugin(plugin, "again")
    assert registry.factory("twice") is Twice


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


PICKY_PLUGIN = """
    import layergraph

    class PickyAdapter(layergraph.Adapter):
        name = "picky"

        def recognizes(self, model):
            raise RuntimeError("recognizes is broken")

        def plan(self, model, context=None):
            return layergraph.WholeForward(model)

    @layergraph.hookimpl
    def register_adapters(register):
        register(PickyAdapter)
"""


def adapters(registry: AdapterRegistry) -> dict[str, plugins.AdapterInfo]:
    return {info.name: info for info in registry.list()}


def registry_with(*factories: Callable[..., layergraph.Adapter]) -> AdapterRegistry:
    """A registry holding only ``factories`` (and layergraph's generic ``sequential``)."""

    class Plugin:
        @layergraph.hookimpl
        def register_adapters(self, register: Callable[..., None]) -> None:
            register(layergraph.SequentialAdapter)
            for factory in factories:
                register(factory)

    registry = AdapterRegistry()
    registry.add_plugin(Plugin(), "local-plugin", "localdist", "0.1")
    return registry


def test_adapter_whose_recognizes_raises_is_passed_over_with_a_warning_and_listed(
    installed_plugin: Callable[..., None],
) -> None:
    installed_plugin("pickyplugin", "picky", PICKY_PLUGIN)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).eval()
    with pytest.warns(plugins.PluginFailureWarning) as warned:
        wrapped = layergraph.wrap(model, adapter="auto")
    assert wrapped.adapter.name == "sequential"  # the generic adapter, next in line
    message = str(warned[0].message)
    for part in ("'picky'", "pickyplugin 1.2.3", "RuntimeError: recognizes is broken"):
        assert part in message
    assert warned[0].filename == __file__  # names the caller's line
    wrapped.unwrap()
    picky = by_name()["picky"]
    assert not picky.ok and picky.distribution == "pickyplugin"
    assert picky.error.startswith("RuntimeError: recognizes is broken")
    assert by_name()["sequential"].ok
    assert layergraph.wrap(model, adapter="picky").adapter.name == "picky"


def test_recognition_failure_keeps_the_first_error() -> None:
    class Flaky(layergraph.Adapter):
        name = "flaky"
        calls = 0

        def recognizes(self, model: torch.nn.Module) -> bool:
            Flaky.calls += 1
            raise ValueError(f"failure {Flaky.calls}")

    registry = registry_with(Flaky)
    for call in (1, 2):
        with (
            pytest.warns(plugins.PluginFailureWarning, match=f"ValueError: failure {call}"),
            pytest.raises(UnknownAdapterError, match="no adapter recognises"),
        ):
            registry.recognize(torch.nn.Linear(2, 2))
    assert adapters(registry)["flaky"].error.startswith("ValueError: failure 1")
    assert registry.factory("flaky") is Flaky


def test_another_dedicated_adapter_may_claim_the_model_a_broken_one_raised_on() -> None:
    class Broken(layergraph.Adapter):
        name = "broken"

        def recognizes(self, model: torch.nn.Module) -> bool:
            raise KeyError("config")

    class Claimer(layergraph.Adapter):
        name = "claimer"

        def recognizes(self, model: torch.nn.Module) -> bool:
            return isinstance(model, torch.nn.Sequential)

    registry = registry_with(Broken, Claimer)
    with pytest.warns(plugins.PluginFailureWarning, match=r"'broken' \(localdist 0\.1\)"):
        assert registry.recognize(torch.nn.Sequential()) == "claimer"
    assert "KeyError: 'config'" in adapters(registry)["broken"].error


def test_adapters_that_need_arguments_are_not_asked_to_recognize() -> None:
    class NeedsStack(layergraph.Adapter):
        name = "needs-stack"

        def __init__(self, stack: str) -> None:
            self.stack = stack

    registry = registry_with(NeedsStack)
    assert registry.recognize(torch.nn.Sequential()) == "sequential"
    assert adapters(registry)["needs-stack"].ok


def test_errors_inside_example_models_propagate() -> None:
    class Buggy:
        @layergraph.hookimpl
        def example_model_names(self) -> list[str]:
            raise TypeError("bug in example_model_names")

        @layergraph.hookimpl
        def example_model(self, name: str) -> ExampleModel | None:
            raise TypeError("bug in example_model")

    registry = registry_with()
    registry.add_plugin(Buggy(), "buggy", "buggydist", "0.1")
    with pytest.raises(TypeError, match="bug in example_model_names"):
        example_model_names(registry)
    with pytest.raises(TypeError, match=r"bug in example_model$"):
        example_model("buggy-model", registry)


def test_example_models_come_from_the_hooks_and_unknown_names_list_them() -> None:
    example = ExampleModel(
        name="tiny", adapter="tiny", build=lambda *_: None, inputs=lambda *_: None
    )

    class Examples:
        @layergraph.hookimpl
        def example_model_names(self) -> list[str]:
            return ["tiny"]

        @layergraph.hookimpl
        def example_model(self, name: str) -> ExampleModel | None:
            return example if name == "tiny" else None

    registry = registry_with()
    registry.add_plugin(Examples(), "examples", "exampledist", "0.1")
    assert example_model_names(registry) == ["tiny"]
    assert example_model("tiny", registry) is example
    with pytest.raises(layergraph.UnknownAdapterError, match="built-in names: tiny"):
        example_model("huge", registry)


def test_examples_of_adapter_methods_still_work_with_a_deprecation_warning() -> None:
    example = ExampleModel(
        name="tiny", adapter="tiny", build=lambda *_: None, inputs=lambda *_: None
    )

    class NeedsStack(layergraph.Adapter):
        name = "needs-stack"

        def __init__(self, stack: str) -> None:
            self.stack = stack

    class Tiny(layergraph.Adapter):
        name = "tiny"

        def example_models(self) -> list[str]:
            return ["tiny"]

        def example_model(self, name: str) -> ExampleModel | None:
            return example if name == "tiny" else None

    registry = registry_with(NeedsStack, Tiny)
    with pytest.warns(LayergraphDeprecationWarning, match="the tiny adapter offers example models"):
        assert example_model_names(registry) == ["tiny"]
    with pytest.warns(LayergraphDeprecationWarning, match="implement the example_model and"):
        assert example_model("tiny", registry) is example
    with pytest.warns(LayergraphDeprecationWarning, match="layergraph.bench.examples.ExampleModel"):
        assert layergraph.ExampleModel is ExampleModel


WRAPPER_PLUGINS = {
    "newwrapper": """
        @layergraph.hookimpl(wrapper=True)
        def register_adapters(register):
            register(Wrapped)
            return (yield)
    """,
    "oldwrapper": """
        @layergraph.hookimpl(hookwrapper=True)
        def register_adapters(register):
            register(Wrapped)
            yield
    """,
    "tryfirst": """
        @layergraph.hookimpl(tryfirst=True)
        def register_adapters(register):
            register(Wrapped)
    """,
}


@pytest.mark.parametrize("style", WRAPPER_PLUGINS)
def test_hookimpl_options_apply_to_register_adapters(
    installed_plugin: Callable[..., None], style: str
) -> None:
    source = """
        import layergraph

        class Wrapped(layergraph.Adapter):
            name = "wrapped"
    """
    hook = textwrap.dedent(WRAPPER_PLUGINS[style])
    installed_plugin(style, "wrapper", textwrap.dedent(source) + hook)
    assert plugins.get_registry().factory("wrapped").__module__ == f"{style}_plugin"
    assert by_name()["wrapped"].distribution == style


def test_wrapper_hookimpl_that_raises_marks_its_plugin_broken(
    installed_plugin: Callable[..., None],
) -> None:
    source = """
        import layergraph

        @layergraph.hookimpl(wrapper=True)
        def register_adapters(register):
            raise RuntimeError("wrapper failed")
            return (yield)
    """
    installed_plugin("raisingwrapper", "failing-wrapper", source)
    infos = by_name()
    assert infos["failing-wrapper"].error == "RuntimeError: wrapper failed"
    assert infos["failing-wrapper"].distribution == "raisingwrapper"
    assert infos["timm"].ok


def test_plugin_implementations_run_in_pluggy_order() -> None:
    order: list[str] = []

    class Plugin:
        @layergraph.hookimpl(specname="register_adapters", trylast=True)
        def last(self, register: Callable[..., None]) -> None:
            order.append("last")

        @layergraph.hookimpl(specname="register_adapters", tryfirst=True)
        def first(self, register: Callable[..., None]) -> None:
            order.append("first")

        @layergraph.hookimpl(specname="register_adapters", wrapper=True)
        def around(self, register: Callable[..., None]) -> Iterator[None]:
            order.append("before")
            yield
            order.append("after")

    AdapterRegistry().add_plugin(Plugin(), "ordered")
    assert order == ["before", "first", "last", "after"]


def test_plugins_implementing_through_specname_are_asked_once() -> None:
    class First(layergraph.Adapter):
        name = "first"

    class Second(layergraph.Adapter):
        name = "second"

    class SpecnamePlugin:
        @layergraph.hookimpl(specname="register_adapters")
        def adapters(self, register: Callable[..., None]) -> None:
            register(First)

    class LaterPlugin:
        @layergraph.hookimpl
        def register_adapters(self, register: Callable[..., None]) -> None:
            register(Second)

    registry = AdapterRegistry()
    registry.add_plugin(SpecnamePlugin(), "specname")
    registry.add_plugin(LaterPlugin(), "later")
    assert {info.name: info.ok for info in registry.list()} == {"first": True, "second": True}


def test_failed_plugin_takes_no_part_in_other_hooks() -> None:
    class Plugin:
        @layergraph.hookimpl
        def register_adapters(self, register: Callable[..., None]) -> None:
            raise RuntimeError("registration failed")

        @layergraph.hookimpl
        def recognize_model(self, model: torch.nn.Module) -> str:
            return "ghost"

    registry = registry_with()
    registry.add_plugin(Plugin(), "half-broken")
    assert adapters(registry)["half-broken"].error == "RuntimeError: registration failed"
    assert registry.recognize(torch.nn.Sequential()) == "sequential"


def adapters_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[str]]:
    """The rows of ``layergraph adapters``' tables, by their first cell."""
    from layergraph import cli

    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["adapters"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells:
            rows[cells[0]] = cells
    return rows


def test_adapters_command_lists_failures(
    installed_plugin: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed_plugin("pickyplugin", "picky", PICKY_PLUGIN)
    wrapper = """
        import layergraph

        @layergraph.hookimpl(hookwrapper=True)
        def register_adapters(register):
            raise RuntimeError("wrapper failed [badly]")
            yield
    """
    installed_plugin("clitestwrapper", "failing-wrapper", wrapper)
    with pytest.warns(plugins.PluginFailureWarning, match="'picky'"):
        layergraph.wrap(torch.nn.Sequential(torch.nn.Linear(2, 2)), adapter="auto").unwrap()
    rows = adapters_command(capsys, monkeypatch)
    assert rows["picky"][1:3] == ["pickyplugin", "1.2.3"]
    assert rows["picky"][3].startswith("RuntimeError: recognizes is broken")
    assert rows["failing-wrapper"][1:] == [
        "clitestwrapper",
        "1.2.3",
        "RuntimeError: wrapper failed [badly]",
    ]
    assert rows["timm"][3] == "ok"
