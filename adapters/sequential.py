"""Plugin registering the generic adapter for any stack of layers applied in sequence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layergraph import SequentialAdapter, hookimpl


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(SequentialAdapter)
