"""layergraph's own attention plugin: registers the built-in backends ``sdpa``, ``triton``, ``fa3``.

The registry adds it when it is made, like any plugin, so the built-in backends are listed,
looked up and chosen exactly as a plugin's are. Their metadata needs no hook: when no plugin
builds metadata for a backend, the registry takes the backend's own ``default_metadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..hookspecs import hookimpl
from .backends import AttentionBackend, Fa3Attention, SdpaAttention, TritonVarlenAttention


@hookimpl
def register_attention_backends(register: Callable[[AttentionBackend], Any]) -> None:
    for backend in (SdpaAttention(), TritonVarlenAttention(), Fa3Attention()):
        register(backend)
