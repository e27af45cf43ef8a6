"""Plugin loading, and the registry of adapters and attention backends.

Plugins are found through the entry-point group ``layergraph``: the first-party adapters of
this distribution and any third party's load the same way, and layergraph's own attention
backends come from a plugin of its own. Each plugin is imported and asked for its adapters and
attention backends on its own, so one that fails (an import error, a misspelled hook, a hook
that raises) is recorded with its distribution and error, and every other plugin keeps working.
The failure is shown when its adapter or a backend is asked for and when adapters are listed.

Set ``LAYERGRAPH_DISABLE_PLUGINS=1`` to load only this distribution's own plugins, or to a
comma-separated list of entry-point or distribution names to skip just those.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from . import hookspecs
from .adapter import Adapter, plan_api_version
from .advice import refusal
from .attention import builtin_backends
from .attention.backends import AttentionBackend
from .attention.layout import (
    AttentionMetadata,
    PackedLayout,
    SequenceLayout,
    check_packed_metadata,
)
from .version import __version__
from .warn import LayergraphDeprecationWarning, warn

if TYPE_CHECKING:
    from .bench.example_model import ExampleModel

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "AdapterInfo",
    "AdapterRegistry",
    "AttentionBackendInfo",
    "PluginFailureWarning",
    "UnknownAdapterError",
    "UnknownAttentionBackendError",
    "get_registry",
    "list_adapters",
    "reset_registry",
]

ENTRY_POINT_GROUP = "layergraph"
DISABLE_ENV = "LAYERGRAPH_DISABLE_PLUGINS"
_OWN_DISTRIBUTION = "layergraph"

AdapterFactory = Callable[..., Adapter]


class UnknownAdapterError(LookupError):
    """No working adapter has the name asked for, or ``adapter="auto"`` could not choose one."""


class UnknownAttentionBackendError(LookupError):
    """No registered attention backend has the name asked for."""


class PluginFailureWarning(UserWarning):
    """An adapter failed while ``adapter="auto"`` chose one (its ``recognizes`` or ``plan``
    raised) and the next adapter that recognises the model was taken; the failure is listed
    with the adapter (``layergraph adapters``)."""


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter, or one plugin that failed to give its adapters.

    For a failed plugin, ``name`` is its entry-point name and ``error`` says what went wrong.
    An adapter whose ``recognizes`` or ``plan`` raised while ``adapter="auto"`` chose keeps its
    entry, with ``error`` set to the first such error: ``adapter="auto"`` passes over it with a
    :class:`PluginFailureWarning`, and naming it (``adapter=name``) still creates it.
    """

    name: str
    distribution: str
    version: str
    error: str | None = None
    note: str | None = None
    """What works but is deprecated (an adapter written for an older plugin API)."""

    @property
    def first_party(self) -> bool:
        """Whether layergraph's own distribution registered it."""
        return self.distribution == _OWN_DISTRIBUTION

    @property
    def ok(self) -> bool:
        """Whether nothing went wrong: the plugin loaded and the adapter never raised."""
        return self.error is None


@dataclass(frozen=True)
class AttentionBackendInfo:
    """One registered attention backend and the distribution whose plugin registered it."""

    name: str
    distribution: str
    version: str


class AdapterRegistry:
    """A pluggy plugin manager and the adapters and attention backends its plugins registered.

    Core code asks this class, never ``pm.hook`` directly. It does not import any model
    framework: plugins import theirs lazily, when an adapter is used. A new registry holds
    layergraph's own attention backends; :meth:`load_entry_points` adds the installed plugins.
    """

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._recognizer = _Recognizer(self._ask_adapters)
        self.plugin_manager.register(self._recognizer, name="layergraph.recognize")
        self._adapters: dict[str, tuple[AdapterFactory, AdapterInfo]] = {}
        self._backends: dict[str, tuple[AttentionBackend, AttentionBackendInfo]] = {}
        self._failures: dict[str, AdapterInfo] = {}
        self._plugin_adapters: dict[str, list[str]] = {}
        self._plugin_backends: dict[str, list[str]] = {}
        self.add_plugin(builtin_backends, "layergraph.attention", _OWN_DISTRIBUTION, __version__)

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
        """Register one plugin object and collect its adapters and attention backends.

        Its ``register_adapters`` and then its ``register_attention_backends`` are called
        through pluggy with that plugin's implementations alone, so hookimpl options apply as
        pluggy documents and one plugin's failure stays its own. A plugin that pluggy refuses,
        or whose hook raises, is unregistered and recorded under ``name``; nothing it
        registered is kept. An adapter whose name is taken is recorded under that name and the
        plugin's other adapters are kept. Raises ``ValueError`` for a plugin object registered
        already (from the entry points, say), which stays as it is.
        """
        manager = self.plugin_manager
        if manager.is_registered(plugin):
            raise ValueError(
                f"plugin {name!r} is registered already (as {manager.get_name(plugin)!r}); "
                f"its adapters and backends are available"
            )
        adapters: list[tuple[AdapterFactory, AdapterInfo]] = []
        backends: list[AttentionBackend] = []
        try:
            manager.register(plugin, name=name)
            manager.check_pending()
            hook = _hooks_of(plugin)
            hook.register_adapters(register=_adapter_collector(adapters, distribution, version))
            hook.register_attention_backends(register=self._backend_collector(backends))
        except Exception as error:
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            self._fail(name, distribution, version, _describe(error))
            return
        self._keep_adapters(name, adapters)
        for backend in backends:
            info = AttentionBackendInfo(backend.name, distribution, version)
            self._backends[backend.name] = (backend, info)
            self._plugin_backends.setdefault(name, []).append(backend.name)

    def _backend_collector(self, found: list[AttentionBackend]) -> Callable[[Any], None]:
        """The ``register`` given to one plugin's ``register_attention_backends``."""

        def register(backend: Any) -> None:
            if not isinstance(backend, AttentionBackend):
                raise TypeError(
                    f"register_attention_backends takes AttentionBackend instances, not {backend!r}"
                )
            name = getattr(backend, "name", None)
            if not isinstance(name, str) or not name:
                raise TypeError(f"{backend!r} has no 'name' attribute naming the backend")
            if name == "auto":
                raise ValueError("attention backend name 'auto' is reserved for choose_backend")
            taken = self._backends.get(name)
            if taken is not None:
                raise ValueError(
                    f"attention backend {name!r} is already registered by {taken[1].distribution}"
                )
            if any(other.name == name for other in found):
                raise ValueError(f"attention backend {name!r} is registered twice")
            found.append(backend)

        return register

    def _keep_adapters(
        self, plugin_name: str, adapters: list[tuple[AdapterFactory, AdapterInfo]]
    ) -> None:
        for factory, info in adapters:
            existing = self._adapters.get(info.name)
            if existing is not None:
                other = existing[1].distribution
                self._fail(
                    info.name, info.distribution, info.version, f"name already taken by {other}"
                )
            else:
                self._adapters[info.name] = (factory, info)
                self._plugin_adapters.setdefault(plugin_name, []).append(info.name)

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin added under ``name``; forget its adapters, backends and failures."""
        if self.plugin_manager.has_plugin(name):
            self.plugin_manager.unregister(name=name)
        self._failures.pop(name, None)
        for adapter_name in self._plugin_adapters.pop(name, []):
            del self._adapters[adapter_name]
        for backend_name in self._plugin_backends.pop(name, []):
            del self._backends[backend_name]

    def _fail(self, name: str, distribution: str, version: str, error: str) -> None:
        self._failures[name] = AdapterInfo(name, distribution, version, error)

    def list(self) -> list[AdapterInfo]:
        """Every adapter and every failed plugin, sorted by name."""
        infos = [info for _, info in self._adapters.values()] + list(self._failures.values())
        return sorted(infos, key=lambda info: (info.name, info.distribution))

    def info(self, name: str) -> AdapterInfo:
        """What the registry knows of the adapter registered as ``name`` (``KeyError`` if
        none is)."""
        return self._adapters[name][1]

    def factory(self, name: str) -> AdapterFactory:
        """The factory registered as ``name``; a clear error if it is unknown or broken.

        An adapter whose ``recognizes`` raised is still returned: ``recognizes`` only serves
        ``adapter="auto"``, and naming the adapter is the way past a bug there.
        """
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
        raise UnknownAdapterError(
            f"no adapter named {name!r}; available: {available}{self._failed_plugins()}"
        )

    def _failed_plugins(self) -> str:
        """``"; failed to load: ..."`` naming every failure, or nothing when there is none."""
        if not self._failures:
            return ""
        broken = "; ".join(
            f"{info.name} ({info.distribution}): {info.error}" for info in self._failures.values()
        )
        return f"; failed to load: {broken}"

    def attention_backend(self, name: str) -> AttentionBackend:
        """The attention backend registered as ``name``; a clear error if there is none.

        ``"auto"`` is not a backend: :func:`~layergraph.attention.choose_backend` resolves it.
        """
        found = self._backends.get(name)
        if found is not None:
            return found[0]
        registered = ", ".join(sorted(self._backends)) or "none"
        raise UnknownAttentionBackendError(
            f"no attention backend named {name!r}; registered: {registered}{self._failed_plugins()}"
        )

    def attention_backend_names(self) -> tuple[str, ...]:
        """The names of the registered attention backends, in the order they were registered."""
        return tuple(self._backends)

    def attention_backends(self) -> tuple[AttentionBackend, ...]:
        """The registered attention backends, in the order they were registered.

        What :func:`~layergraph.attention.choose_backend` takes as its candidates.
        """
        return tuple(backend for backend, _ in self._backends.values())

    def list_attention_backends(self) -> list[AttentionBackendInfo]:
        """Every registered attention backend with its distribution, sorted by name."""
        return sorted((info for _, info in self._backends.values()), key=lambda info: info.name)

    def attention_metadata(
        self,
        backend: str | AttentionBackend,
        layout: SequenceLayout | PackedLayout,
        device: torch.device,
    ) -> AttentionMetadata:
        """The metadata for ``backend`` and ``layout``: the first plugin's, else the backend's.

        Plugins' ``attention_metadata`` hooks are asked first (with the backend's name), so
        they may build it for any backend, registered or not; when none does, the backend's
        own ``default_metadata`` builds it: the registered backend of that name, or
        ``backend`` itself when an adapter gives an instance it offers beside the registered
        ones. Metadata for a packed layout is checked to hold every call of it.
        """
        name = backend if isinstance(backend, str) else backend.name
        metadata = self.plugin_manager.hook.attention_metadata(
            backend=name, layout=layout, device=device
        )
        source = "an attention_metadata hook"
        if metadata is None:
            if isinstance(backend, str):
                backend = self.attention_backend(backend)
            metadata = backend.default_metadata(layout, device)
            source = f"the {name} backend"
        if isinstance(layout, PackedLayout):
            check_packed_metadata(metadata, layout, source)
        return metadata

    def capture_contexts(self, model: torch.nn.Module) -> list[AbstractContextManager[Any]]:
        """Every plugin's context for capturing ``model``'s graphs (the ``capture_context``
        hook), to be entered around each warm-up and capture."""
        return list(self.plugin_manager.hook.capture_context(model=model))

    def eager_checks(self, model: torch.nn.Module) -> list[Callable[[], str | None]]:
        """Every plugin's check of whether a call of ``model`` must run eagerly now (the
        ``eager_check`` hook), asked before each call the graphs would serve."""
        return [check for check in self.plugin_manager.hook.eager_check(model=model) if check]

    def recognize(self, model: torch.nn.Module, skip: Collection[str] = ()) -> str:
        """The name of the adapter that serves ``model``, passing over those in ``skip``
        (adapters that failed on it); a clear error if none does.

        Plugins' ``recognize_model`` hooks are asked first, then each adapter's ``recognizes``
        (see :func:`~layergraph.hookspecs.recognize_model`): layergraph's own dedicated
        adapters, other distributions' dedicated adapters, then the generic ones in the same
        order. An adapter whose ``recognizes`` raises is listed as failed with its error and
        passed over, with a :class:`PluginFailureWarning` naming it. Naming the adapter
        still creates it.
        """
        if skip:
            name = next(
                (
                    found
                    for found in self._hook_answers(model, skip)
                    if found is not None and found not in skip
                ),
                None,
            )
        else:
            name = self.plugin_manager.hook.recognize_model(model=model)
        if name is None:
            raise UnknownAdapterError(refusal(model, self.dedicated, sorted(self._adapters)))
        return name

    def dedicated(self, part: torch.nn.Module) -> str | None:
        """The dedicated (not generic) adapter that ``adapter="auto"`` would choose for
        ``part``, or ``None``; a plugin failing on it answers ``None``."""
        try:
            name = self.plugin_manager.hook.recognize_model(model=part)
        except Exception:  # a plugin failing on a part leaves the answer to the others
            return None
        entry = self._adapters.get(name) if name is not None else None
        if entry is None or getattr(entry[0], "generic", False):
            return None
        return name

    def _hook_answers(self, model: torch.nn.Module, skip: Collection[str]) -> Iterator[Any]:
        """Each ``recognize_model`` implementation's answer, in the order pluggy calls them
        (layergraph's own last, passing over the adapters in ``skip``)."""
        for implementation in reversed(self.plugin_manager.hook.recognize_model.get_hookimpls()):
            if implementation.plugin is self._recognizer:
                yield self._ask_adapters(model, skip)
            else:
                yield implementation.function(model=model)

    def _ask_adapters(self, model: torch.nn.Module, skip: Collection[str] = ()) -> str | None:
        """The first adapter whose ``recognizes(model)`` is true, in the order of
        :meth:`recognize`; one that raises is recorded, warned of, and passed over."""
        for name, factory in self._adapters_in_order():
            if name in skip:
                continue
            try:
                recognized = factory().recognizes(model)
            except Exception as error:
                self.record_failure(name, model, "recognizes", error)
                continue
            if recognized:
                return name
        return None

    def _adapters_in_order(self) -> list[tuple[str, AdapterFactory]]:
        """The adapters ``adapter="auto"`` asks, in the order it asks them: dedicated before
        generic, and within each layergraph's own before other distributions' (each group in
        the order they were registered)."""
        ordered = []
        for generic in (False, True):
            for first_party in (True, False):
                for name, factory in self.default_factories():
                    info = self._adapters[name][1]
                    if (
                        bool(getattr(factory, "generic", False)) is generic
                        and info.first_party is first_party
                    ):
                        ordered.append((name, factory))
        return ordered

    def record_failure(
        self, name: str, model: torch.nn.Module, method: str, error: BaseException
    ) -> None:
        """Record that adapter ``name``'s ``method`` (``recognizes`` or ``plan``) raised on
        ``model`` while ``adapter="auto"`` chose, keeping the first error, and warn with a
        :class:`PluginFailureWarning` naming the adapter and its distribution."""
        factory, info = self._adapters[name]
        described = _describe(error)
        if info.ok:
            error_text = (
                f"{described} (raised by {method}() on {_type_name(model)}; "
                f"adapter={name!r} still works when named)"
            )
            self._adapters[name] = (factory, dataclasses.replace(info, error=error_text))
        warn(
            f"adapter {name!r} ({info.distribution} {info.version}) raised {described} in "
            f"{method}() on {_type_name(model)}; adapter='auto' passes over it to the next "
            f"adapter that recognises the model (layergraph adapters lists the failure)",
            PluginFailureWarning,
        )

    def default_factories(self) -> list[tuple[str, AdapterFactory]]:
        """Each adapter's name and factory, for the factories that need no arguments."""
        return [
            (name, factory)
            for name, (factory, _) in self._adapters.items()
            if _callable_without_arguments(factory)
        ]

    def example_model(self, name: str) -> ExampleModel:
        """The example model ``name`` from the plugins' ``example_model`` hook (or a deprecated
        ``Adapter.example_model``); :class:`UnknownAdapterError` lists those there are."""
        found = self.plugin_manager.hook.example_model(name=name) or next(
            self._from_adapters(lambda adapter: adapter.example_model(name)), None
        )
        if found is None:
            raise UnknownAdapterError(
                f"no plugin builds a model called {name!r}; built-in names: "
                f"{', '.join(self.example_model_names())}, or timm:NAME for any timm ViT, "
                f"open_clip:NAME for any open_clip architecture"
            )
        return found

    def example_model_names(self) -> list[str]:
        """The names the ``example_model_names`` hooks list, sorted."""
        listed = self.plugin_manager.hook.example_model_names()
        listed += self._from_adapters(lambda adapter: adapter.example_models())
        return sorted({name for names in listed for name in names})

    def _from_adapters(self, ask: Callable[[Adapter], Any]) -> Iterator[Any]:
        """Each answer of ``ask(adapter)`` from an adapter made without options, deprecated."""
        for _, factory in self.default_factories():
            if answer := ask(adapter := factory()):
                warn(
                    f"the {adapter.name} adapter offers example models through its deprecated "
                    f"example_model(s) methods: implement the example_model and "
                    f"example_model_names hooks in its plugin instead (they go in 0.3)",
                    LayergraphDeprecationWarning,
                )
                yield answer

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

    def __init__(self, ask_adapters: Callable[[torch.nn.Module], str | None]) -> None:
        self._ask_adapters = ask_adapters

    @hookspecs.hookimpl(trylast=True)
    def recognize_model(self, model: torch.nn.Module) -> str | None:
        return self._ask_adapters(model)


def _hooks_of(plugin: Any) -> pluggy.HookRelay:
    """The hooks of a plugin manager that holds ``plugin`` alone, to call its implementations
    (pluggy's ``subset_hook_caller`` before pluggy 1.7 calls ``specname`` implementations of
    other plugins too)."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin)
    return manager.hook


def _adapter_collector(
    found: list[tuple[AdapterFactory, AdapterInfo]], distribution: str, version: str
) -> Callable[[AdapterFactory], None]:
    """The ``register`` given to one plugin's ``register_adapters``."""

    def register(factory: AdapterFactory) -> None:
        adapter_name = getattr(factory, "name", "")
        if not isinstance(adapter_name, str) or not adapter_name:
            raise TypeError(f"{factory!r} has no 'name' attribute naming the adapter")
        note = None
        if plan_api_version(factory) == 1:
            note = (
                "deprecated: plan(model) is plugin API 1; add a context parameter "
                "(plan(model, context)) before layergraph 0.3"
            )
        found.append((factory, AdapterInfo(adapter_name, distribution, version, note=note)))

    return register


def _callable_without_arguments(factory: AdapterFactory) -> bool:
    """Whether ``factory()`` is a valid call, judged from its signature without calling it."""
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (some built-ins): calling it is the only test
        return True
    return True


def _type_name(model: torch.nn.Module) -> str:
    return f"{type(model).__module__}.{type(model).__name__}"


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
