"""Attention that a compiled layer calls as one operator, whatever the bound state holds.

A routed attention reads the state bound for the key being served (its backend, layout,
metadata and workspace) in Python. Compiled (``compile_layers``), that Python would be traced:
Dynamo would guard on the state (a layout's sequence count, a backend's settings) and compile
the layer again for every batch size or token budget. :func:`opaque_attention` hands q, k and v
to a named route instead; under ``torch.compile`` it is the custom operator
``layergraph::opaque_attention``, which Dynamo keeps as it is and whose implementation runs the
route at run time, so one compiled layer serves every key and keeps the kernel each key's
state chose. Called eagerly, it runs the route directly. It does not choose a backend or build
metadata: the adapter's bound state does. A layer whose attention depends on which boundaries it
was given (a tower's windowed layers) passes them as ``boundaries``, a tensor the route reads at
run time, rather than choosing in Python, which would compile one version per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Route", "opaque_attention", "register_route"]

Route = Callable[..., torch.Tensor]
"""Attention over ``[tokens, heads, head_dim]`` q, k and v with a scale (and, where the caller
gives them, its ``boundaries`` as a fifth argument), read from the state bound at run time;
returns ``[tokens, heads, v's head_dim]``."""

_ROUTES: dict[str, Route] = {}


def register_route(name: str, route: Route) -> None:
    """Make ``route`` callable as ``opaque_attention(..., route=name)``; a name is one routing
    (an adapter's), the same for every layer, so that the layers share one compiled version."""
    _ROUTES[name] = route


def opaque_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    route: str,
    scale: float,
    boundaries: torch.Tensor | None = None,
) -> torch.Tensor:
    """The route ``route``'s attention of q, k and v (given ``boundaries``, where not
    ``None``): one operator to ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.layergraph.opaque_attention(q, k, v, route, scale, boundaries)
    return _run(q, k, v, route, scale, boundaries)


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    route: str,
    scale: float,
    boundaries: torch.Tensor | None,
) -> torch.Tensor:
    if boundaries is None:
        return _ROUTES[route](q, k, v, scale)
    return _ROUTES[route](q, k, v, scale, boundaries)


@torch.library.custom_op("layergraph::opaque_attention", mutates_args=())
def _opaque_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    route: str,
    scale: float,
    boundaries: torch.Tensor | None,
) -> torch.Tensor:
    """The route run at run time, opaque to the compiler."""
    return _run(q, k, v, route, scale, boundaries)


@_opaque_attention_op.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    route: str,
    scale: float,
    boundaries: torch.Tensor | None,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])
