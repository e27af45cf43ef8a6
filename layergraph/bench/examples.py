"""Example models: towers and VLMs built from their configurations with random weights, and
inputs for them, so that the demo, ``layergraph bench`` and the benchmarks download nothing.

Plugins offer them through two hooks, apart from their adapters: ``example_model(name)``
(the first plugin that builds ``name`` answers) and ``example_model_names()`` (the names worth
listing). layergraph's own are in ``layergraph_adapters.example_models``. Serving code never
asks for them.
"""

from __future__ import annotations

from layergraph.plugins import AdapterRegistry, get_registry

from .example_model import ExampleModel

__all__ = ["ExampleModel", "example_model", "example_model_names"]


def example_model(name: str, registry: AdapterRegistry | None = None) -> ExampleModel:
    """The example model called ``name`` (:meth:`AdapterRegistry.example_model` of
    ``registry``, by default the installed plugins')."""
    return (registry or get_registry()).example_model(name)


def example_model_names(registry: AdapterRegistry | None = None) -> list[str]:
    """Every example model name the plugins list, sorted
    (:meth:`AdapterRegistry.example_model_names`)."""
    return (registry or get_registry()).example_model_names()
