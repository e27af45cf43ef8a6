"""layergraph's own ``attention_metadata`` hook: the metadata of the built-in backends."""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from .backends import get_backend
from .layout import AttentionMetadata, SequenceLayout


@hookimpl(trylast=True)
def attention_metadata(
    backend: str, layout: SequenceLayout, device: torch.device
) -> AttentionMetadata | None:
    try:
        return get_backend(backend).default_metadata(layout, device)
    except ValueError:
        return None
