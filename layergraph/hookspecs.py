"""The hooks a layergraph plugin may implement.

A plugin is a module or object exposed through the entry-point group ``layergraph``::

    [project.entry-points.layergraph]
    mymodels = "mymodels_layergraph"

whose functions are marked with :data:`hookimpl`. Hooks are called with keyword arguments
only, so an implementation may accept a subset of a hook's parameters, in any order. Hooks are
called through pluggy, so the options of :data:`hookimpl` (``wrapper``, ``hookwrapper``,
``tryfirst``, ``trylast``, ``specname``) work as pluggy documents them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .adapter import Adapter
    from .attention.backends import AttentionBackend
    from .attention.layout import AttentionMetadata, PackedLayout, SequenceLayout
    from .bench.example_model import ExampleModel

__all__ = [
    "PROJECT_NAME",
    "attention_metadata",
    "capture_context",
    "eager_check",
    "example_model",
    "example_model_names",
    "hookimpl",
    "hookspec",
    "recognize_model",
    "register_adapters",
    "register_attention_backends",
]

PROJECT_NAME = "layergraph"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_adapters(register: Callable[[type[Adapter] | Callable[..., Adapter]], Any]) -> None:
    """Register this plugin's adapters.

    Call ``register(factory)`` once per adapter, where ``factory`` is an
    :class:`~layergraph.Adapter` subclass (or any callable returning an adapter) with a class
    attribute ``name``. ``wrap(model, adapter=name, **options)`` calls ``factory(**options)``
    with the options the runner does not take.

    Called once for every plugin, each on its own (through pluggy, with only that plugin's
    implementations), when the plugin is loaded: the first time adapters or attention backends
    are looked up; the return value is ignored. If it raises, the plugin fails as a whole: it is
    unregistered, none of its adapters or attention backends are kept, and it is listed as
    failed with its distribution and error; the other plugins' adapters stay available.
    """


@hookspec
def register_attention_backends(register: Callable[[AttentionBackend], Any]) -> None:
    """Register this plugin's attention backends.

    Call ``register(backend)`` once per backend, with an instance of
    :class:`~layergraph.attention.AttentionBackend` whose ``name`` no registered backend has
    (``auto`` is reserved). Adapters that route attention then take it by name (InternVL's
    ``attention=NAME``), ``auto`` times it with the others on a GPU, and its metadata comes from
    the ``attention_metadata`` hook, or from its own ``default_metadata`` when no plugin builds
    it. layergraph registers its own backends (``sdpa``, ``triton``, ``fa3``) through this hook.

    Called once for every plugin, each on its own, right after its ``register_adapters``; the
    return value is ignored. ``register`` raises ``TypeError`` for anything but a backend
    instance and ``ValueError`` for a name already taken. If the hook raises (those errors
    included), the plugin fails as a whole, as for ``register_adapters``: none of its adapters
    or backends are kept, and the error is listed with its distribution.
    """


@hookspec(firstresult=True)
def attention_metadata(
    backend: str, layout: SequenceLayout | PackedLayout, device: torch.device
) -> AttentionMetadata | None:
    """Build the metadata attention ``backend`` needs for ``layout`` on ``device``.

    Called once per shape key before its graph is captured, and once per layout for eager
    calls. The first result that is not ``None`` wins; return ``None`` to leave a backend or
    layout to others. When every plugin returns ``None``, the registry builds the backend's own
    ``default_metadata(layout, device)``, so a plugin overrides any backend's metadata,
    built-in or not, by returning its own. The returned tensors must not be replaced
    afterwards: a captured graph reads them at the addresses they had during capture.

    ``layout`` is a :class:`~layergraph.attention.SequenceLayout` (the lengths of one key, known
    when the metadata is built), or for a packed plan's token budget a
    :class:`~layergraph.attention.PackedLayout` (room for ``slots`` sequences of at most
    ``max_length`` tokens, ``tokens`` in all), asked once per budget and kind of attention
    (Qwen2.5-VL: full and windowed). Metadata for a packed layout holds int32 ``cu_seqlens`` of
    ``slots + 1`` elements, ``seq_lens`` of ``slots`` or ``None``, and ``max_seqlen`` of at
    least ``max_length`` (checked); the plan writes each call's boundaries into those tensors in
    place before every replay, and the backend reads them when it runs.
    """


@hookspec(firstresult=True)
def recognize_model(model: nn.Module) -> str | None:
    """The name of the adapter that serves ``model``, for ``wrap(model, adapter="auto")``.

    The first result that is not ``None`` wins; return ``None`` to leave ``model`` to others.
    Must not import a framework the user has not imported.

    layergraph's own implementation runs last: it asks every registered adapter that can be
    made without options for ``recognizes(model)``, dedicated adapters before generic ones
    (``Adapter.generic``), and within each layergraph's own adapters before other
    distributions' (a plugin that wants a model a first-party adapter serves claims it here,
    or its users name it). An adapter whose ``recognizes`` raises is listed as failed (its
    first error kept) and passed over with a ``PluginFailureWarning``; so is another
    distribution's adapter whose ``plan`` raises anything but ``AdapterMismatch`` when ``wrap``
    makes it.
    """


@hookspec
def capture_context(model: nn.Module) -> AbstractContextManager[Any] | None:
    """A context to enter around every warm-up and capture of ``model``'s graphs, or ``None``.

    For frameworks whose code takes another path while a CUDA stream is being captured than
    it takes eagerly, where that path is slower or differs and the eager one is safe to
    capture. layergraph's own ``transformers`` plugin uses it for transformers 5.9 to 5.17,
    whose attention-mask helpers build a mask only under capture (one that no fused attention
    kernel accepts, so SDPA falls back to float32 matrix products). Called before each capture
    (``model`` is the wrapped model); every plugin's context that is not ``None`` is entered, in
    pluggy's order. Eager calls, measured or not, never run inside it. Must not import a
    framework the user has not imported.
    """


@hookspec
def eager_check(model: nn.Module) -> Callable[[], str | None] | None:
    """A function asked before every call of ``model`` that graphs would serve: why the call
    must run eagerly at that moment (a sentence for ``stats``), or ``None``; or ``None`` for no
    such function.

    For frameworks that collect results through Python outside the graphed region while it
    runs (hooks appending layers' outputs to a list that a forward around the region set up),
    which a replay would not run. layergraph's own ``transformers`` plugin returns one for
    transformers' output-capturing hooks. Called once, when the model is wrapped (``model`` is
    the wrapped model); the function is called on every call and must be cheap. Must not
    import a framework the user has not imported.
    """


@hookspec(firstresult=True)
def example_model(name: str) -> ExampleModel | None:
    """The example model called ``name`` that this plugin builds, or ``None``.

    An :class:`~layergraph.bench.examples.ExampleModel`: a model built from its configuration
    with random weights and inputs for it, for the demo, ``layergraph bench`` and the
    benchmarks, so that nothing is downloaded. The first result that is not ``None`` wins.
    Building happens when its ``build`` is called, not here; must not import a framework the
    user has not imported unless ``name`` is this plugin's.
    """


@hookspec
def example_model_names() -> list[str]:
    """The names of the example models this plugin builds that are worth listing
    (``layergraph bench --list``); ``example_model`` may build others (any timm name, say)."""
