"""Capturing transformers models as they run eagerly: the ``transformers`` plugin.

transformers 5.9 to 5.17 take another path in their attention-mask helpers while a CUDA
stream is being captured: ``masking_utils.is_tracing()`` counts stream capture as tracing, so
a model called without a padding mask (ViT, DeiT, BEiT, Idefics2/3's vision towers and
others that call ``create_bidirectional_mask``) builds an all-true mask under capture, where
its eager calls build none. That mask is broadcast (its last dimension has stride 0), which no
fused SDPA kernel accepts, so attention inside the graph falls back to float32 matrix
products: a graph of ViT-Base at batch 32 replayed in 9.7 ms on an H200, against 3.3 ms of
kernels eagerly. transformers 5.18 asks the question only of a padding mask that exists.

:func:`capture_context` makes the mask helpers answer as transformers 5.18 does while
layergraph captures, and leaves everything else alone: a model given a padding mask still
builds its mask under capture (that mask depends on the data), and code outside
``masking_utils`` keeps its own ``is_tracing``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from layergraph import hookimpl

__all__ = ["capture_context", "masks_as_eager"]

AFFECTED = ">=5.9.0,<5.18"
"""The transformers releases whose mask helpers take the capture path."""


@hookimpl
def capture_context(model: nn.Module) -> AbstractContextManager[Any] | None:
    """:func:`masks_as_eager` where the installed transformers takes the capture path, and
    transformers is imported; else ``None``."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    from packaging.specifiers import SpecifierSet

    if not SpecifierSet(AFFECTED).contains(transformers.__version__, prereleases=True):
        return None
    return masks_as_eager()


@contextlib.contextmanager
def masks_as_eager() -> Iterator[None]:
    """Within, ``transformers.masking_utils.is_tracing()`` called without a tensor ignores CUDA
    stream capture (Dynamo and TorchScript tracing still count), as transformers 5.18's mask
    helpers do; called with a tensor it answers as before."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    original = masking_utils.is_tracing

    def is_tracing(tensor: Any = None) -> bool:
        if tensor is not None:
            return original(tensor)
        return bool(import_utils.is_torchdynamo_compiling() or import_utils.is_jit_tracing())

    masking_utils.is_tracing = is_tracing
    try:
        yield
    finally:
        masking_utils.is_tracing = original
