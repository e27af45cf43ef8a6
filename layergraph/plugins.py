"""Plugin loading and the adapter registry.

Plugins are found through the entry-point group ``layergraph``: the first-party adapters of
this distribution and any third party's load the same way. Each plugin is imported and asked
for its adapters on its own, so one that fails (an import error, a misspelled hook, a hook that
raises) is recorded with its distribution and error, and every other plugin keeps working.
The failure is shown when its adapter is asked for and when adapters are listed.

Set ``LAYERGRAPH_DISABLE_PLUGINS=1`` to load only this distribution's own plugins, or to a
comma-separated list of entry-point or distribution names to skip just those.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy
import torch

from . import hookspecs
from .adapter import Adapter, ExampleModel
from .attention import metadata_hooks
from .attention.layout import AttentionMetadata, SequenceLayout

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "AdapterInfo",
    "AdapterRegistry",
    "UnknownAdapterError",
    "get_registry",
    "list_adapters",
    "reset_registry",
]

ENTRY_POINT_GROUP = "layergraph"
DISABLE_ENV = "LAYERGRAPH_DISABLE_PLUGINS"
_OWN_DISTRIBUTION = "layergraph"

AdapterFactory = Callable[..., Adapter]


class UnknownAdapterError(LookupError):
    """No working adapter has the name asked for."""


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter, or one plugin that failed to give its adapters.

    For a failed plugin, ``name`` is its entry-point name and ``error`` says what went wrong.
    """

    name: str
    distribution: str
    version: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the adapter can be used."""
        return self.error is None


class AdapterRegistry:
    """A pluggy plugin manager and the adapters its plugins registered.

    Core code asks this class, never ``pm.hook`` directly. It does not import any model
    framework: plugins import theirs lazily, when an adapter is used.
    """

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self.plugin_manager.register(metadata_hooks, name="layergraph.attention")
        self.plugin_manager.register(_Recognizer(self), name="layergraph.recognize")
        self._adapters: dict[str, tuple[AdapterFactory, AdapterInfo]] = {}
        self._failures: dict[str, AdapterInfo] = {}
        self._plugin_adapters: dict[str, list[str]] = {}

    def load_entry_points(self, disable: str | None = None) -> None:
        """Load every plugin of the entry-point group, skipping those ``disable`` names."""
        for entry_point in sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name
        ):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else "?"
            if self.plugin_manager.has_plugin(entry_point.name):
                continue
            if _is_disabled(disable, entry_point.name, dist_name):
                self._fail(entry_point.name, dist_name, version, f"disabled by {DISABLE_ENV}")
                continue
            try:
                plugin = entry_point.load()
            except Exception as error:
                self._fail(entry_point.name, dist_name, version, _describe(error))
                continue
            self.add_plugin(plugin, entry_point.name, dist_name, version)

    def add_plugin(
        self, plugin: Any, name: str, distribution: str = "<local>", version: str = "-"
    ) -> None:
        """Register one plugin object and collect its adapters, isolating its failures."""
        manager = self.plugin_manager
        try:
            manager.register(plugin, name=name)
            manager.check_pending()
        except Exception as error:
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            self._fail(name, distribution, version, _describe(error))
            return
        registered: list[tuple[AdapterFactory, AdapterInfo]] = []

        def register(factory: AdapterFactory) -> None:
            adapter_name = getattr(factory, "name", "")
            if not isinstance(adapter_name, str) or not adapter_name:
                raise TypeError(f"{factory!r} has no 'name' attribute naming the adapter")
            registered.append((factory, AdapterInfo(adapter_name, distribution, version)))

        for impl in manager.hook.register_adapters.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                impl.function(register=register)
            except Exception as error:
                self._fail(name, distribution, version, _describe(error))
                return
        for factory, info in registered:
            existing = self._adapters.get(info.name)
            if existing is not None:
                other = existing[1].distribution
                self._fail(info.name, distribution, version, f"name already taken by {other}")
            else:
                self._adapters[info.name] = (factory, info)
                self._plugin_adapters.setdefault(name, []).append(info.name)

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin added under ``name`` and forget its adapters and failures."""
        if self.plugin_manager.has_plugin(name):
            self.plugin_manager.unregister(name=name)
        self._failures.pop(name, None)
        for adapter_name in self._plugin_adapters.pop(name, []):
            del self._adapters[adapter_name]

    def _fail(self, name: str, distribution: str, version: str, error: str) -> None:
        self._failures[name] = AdapterInfo(name, distribution, version, error)

    def list(self) -> list[AdapterInfo]:
        """Every adapter and every failed plugin, sorted by name."""
        infos = [info for _, info in self._adapters.values()] + list(self._failures.values())
        return sorted(infos, key=lambda info: (info.name, info.distribution))

    def factory(self, name: str) -> AdapterFactory:
        """The factory registered as ``name``; a clear error if it is unknown or broken."""
        found = self._adapters.get(name)
        if found is not None:
            return found[0]
        failure = self._failures.get(name)
        if failure is not None:
            raise UnknownAdapterError(
                f"adapter {name!r} from {failure.distribution} {failure.version} is unavailable: "
                f"{failure.error}"
            )
        available = ", ".join(sorted(self._adapters)) or "none"
        message = f"no adapter named {name!r}; available: {available}"
        if self._failures:
            broken = "; ".join(
                f"{info.name} ({info.distribution}): {info.error}"
                for info in self._failures.values()
            )
            message += f"; failed to load: {broken}"
        raise UnknownAdapterError(message)

    def attention_metadata(
        self, backend: str, layout: SequenceLayout, device: torch.device
    ) -> AttentionMetadata:
        """The metadata for ``backend`` and ``layout`` from the first plugin that builds it."""
        metadata = self.plugin_manager.hook.attention_metadata(
            backend=backend, layout=layout, device=device
        )
        if metadata is None:
            raise LookupError(
                f"no plugin builds attention metadata for backend {backend!r} and layout {layout}"
            )
        return metadata

    def recognize(self, model: torch.nn.Module) -> str:
        """The name of the adapter that serves ``model``; a clear error if none does."""
        name = self.plugin_manager.hook.recognize_model(model=model)
        if name is None:
            available = ", ".join(sorted(self._adapters)) or "none"
            raise UnknownAdapterError(
                f"no adapter recognises {type(model).__module__}.{type(model).__name__}; name "
                f"one with wrap(model, adapter=NAME). Available: {available}. For a stack of "
                f"layers applied in sequence: adapter='sequential', stack='path.to.layers'"
            )
        return name

    def example_model(self, name: str) -> ExampleModel:
        """The example model called ``name`` from whichever adapter builds it."""
        for factory, _ in self._adapters.values():
            try:
                example = factory().example_model(name)
            except TypeError:
                continue
            if example is not None:
                return example
        raise UnknownAdapterError(
            f"no adapter builds a model called {name!r}; built-in names: "
            f"{', '.join(self.example_model_names())}, or timm:NAME for any timm ViT"
        )

    def example_model_names(self) -> list[str]:
        """Every example model name the registered adapters list."""
        names: list[str] = []
        for factory, _ in self._adapters.values():
            try:
                names += factory().example_models()
            except TypeError:
                continue
        return sorted(names)

    def create(self, name: str, options: dict[str, Any]) -> Adapter:
        """An adapter instance from the factory named ``name``, given adapter ``options``."""
        factory = self.factory(name)
        try:
            inspect.signature(factory).bind(**options)
        except TypeError:
            accepted = ", ".join(inspect.signature(factory).parameters) or "none"
            raise TypeError(
                f"adapter {name!r} does not take option(s) {', '.join(map(repr, options))}; "
                f"its options: {accepted}"
            ) from None
        except ValueError:
            pass
        return factory(**options)


class _Recognizer:
    """layergraph's own ``recognize_model``: asks each registered adapter, generic ones last."""

    def __init__(self, registry: AdapterRegistry) -> None:
        self._registry = registry

    @hookspecs.hookimpl(trylast=True)
    def recognize_model(self, model: torch.nn.Module) -> str | None:
        factories = [factory for factory, _ in self._registry._adapters.values()]
        factories.sort(key=lambda factory: bool(getattr(factory, "generic", False)))
        for factory in factories:
            try:
                recognized = factory().recognizes(model)
            except Exception:
                continue
            if recognized:
                return factory.name
        return None


def _is_disabled(setting: str | None, entry_point: str, distribution: str) -> bool:
    if not setting or setting.strip().lower() in {"0", "false", "no", ""}:
        return False
    if setting.strip().lower() in {"1", "true", "yes", "all"}:
        return distribution != _OWN_DISTRIBUTION
    names = {part.strip() for part in setting.split(",")}
    return entry_point in names or distribution in names


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


_registry: AdapterRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> AdapterRegistry:
    """The process-wide registry, loading the entry points on first use."""
    global _registry
    with _registry_lock:
        if _registry is None:
            registry = AdapterRegistry()
            registry.load_entry_points(os.environ.get(DISABLE_ENV))
            _registry = registry
        return _registry


def reset_registry() -> None:
    """Forget the loaded plugins; the next lookup loads the entry points again."""
    global _registry
    with _registry_lock:
        _registry = None


def list_adapters() -> list[AdapterInfo]:
    """Every adapter available (name, distribution, version), and every plugin that failed."""
    return get_registry().list()
