"""The hooks a layergraph plugin may implement.

A plugin is a module or object exposed through the entry-point group ``layergraph``::

    [project.entry-points.layergraph]
    mymodels = "mymodels_layergraph"

whose functions are marked with :data:`hookimpl`. Hooks are called with keyword arguments
only, so an implementation may accept a subset of a hook's parameters, in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .adapter import Adapter
    from .attention.layout import AttentionMetadata, SequenceLayout

__all__ = [
    "PROJECT_NAME",
    "attention_metadata",
    "hookimpl",
    "hookspec",
    "recognize_model",
    "register_adapters",
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

    Called once for every plugin, each on its own, the first time adapters are looked up; the
    return value is ignored. If it raises, that plugin's adapters are marked broken with the
    error and the other plugins' adapters stay available.
    """


@hookspec(firstresult=True)
def attention_metadata(
    backend: str, layout: SequenceLayout, device: torch.device
) -> AttentionMetadata | None:
    """Build the metadata attention ``backend`` needs for ``layout`` on ``device``.

    Called once per shape key before its graph is captured, and once per layout for eager
    calls. The first result that is not ``None`` wins; return ``None`` to leave a backend or
    layout to others. layergraph's own implementation runs last and builds the metadata of the
    built-in backends (``sdpa``, ``triton``, ``fa3``) for any layout, so a plugin overrides it
    by returning its own. The returned tensors must not be replaced afterwards: a captured
    graph reads them at the addresses they had during capture.
    """


@hookspec(firstresult=True)
def recognize_model(model: nn.Module) -> str | None:
    """The name of the adapter that serves ``model``, for ``wrap(model, adapter="auto")``.

    The first result that is not ``None`` wins; return ``None`` to leave ``model`` to others.
    layergraph's own implementation runs last: it asks every registered adapter's
    ``recognizes(model)``, dedicated adapters before generic ones (``Adapter.generic``), and
    must not import a framework the user has not imported.
    """
