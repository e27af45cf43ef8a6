"""layergraph's pytest plugin (entry point ``pytest11``, name ``layergraph``): the fixtures
``layergraph_registry`` and ``register_adapter`` for adapter authors' tests.

A module of its own, outside the ``layergraph`` package, so that a pytest run in an environment
where layergraph is installed imports neither layergraph nor PyTorch until a test asks for one
of these fixtures. The rest of the testing tools (``SimulatedGraphs``, ``check_adapter``) are
in :mod:`layergraph.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["layergraph_registry", "register_adapter"]


@pytest.fixture
def layergraph_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh plugin registry, loaded from the installed entry points, used by ``wrap``.

    Changes made through it (plugins added or removed) end with the test.
    """
    from layergraph import plugins

    registry = plugins.AdapterRegistry()
    registry.load_entry_points()
    monkeypatch.setattr(plugins, "_registry", registry)
    yield registry


@pytest.fixture
def register_adapter(layergraph_registry: Any) -> Callable[[Any], None]:
    """``register_adapter(AdapterClass)``: available by its name to ``wrap`` for this test."""
    from layergraph.hookspecs import hookimpl

    def register(factory: Any) -> None:
        class _TestPlugin:
            @hookimpl
            def register_adapters(self, register: Callable[[Any], Any]) -> None:
                register(factory)

        layergraph_registry.add_plugin(_TestPlugin(), f"test:{factory.name}")

    return register
