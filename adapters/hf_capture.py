"""Capturing transformers models as they run eagerly: the ``transformers`` plugin.

Two things transformers does in Python around a model's layers that a graph must know of.

**Output-capturing hooks.** transformers 5 collects ``hidden_states`` and ``attentions``
through forward hooks on the layers, appending to lists that the forward decorated with
``capture_outputs`` sets up for the call. A region graphed inside such a forward (the
``sequential`` adapter's stack of layers) would append at capture only and never at replay:
:func:`eager_check` makes the calls that collect that way run eagerly, with the reason.
Regions that hold the whole decorated forward collect inside the graph and are served.

**Masks under capture.**

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
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from layergraph import hookimpl

__all__ = ["capture_context", "collecting_outputs", "eager_check", "masks_as_eager"]

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


@hookimpl
def eager_check(model: nn.Module) -> Callable[[], str | None] | None:
    """:func:`collecting_outputs` where the installed transformers collects outputs through
    hooks, and transformers is imported; else ``None``."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.utils import output_capturing
    except ImportError:  # a transformers that collects outputs inline, in the forward
        return None
    collector = getattr(output_capturing, "_active_collector", None)
    return None if collector is None else functools.partial(collecting_outputs, collector)


def collecting_outputs(collector: Any) -> str | None:
    """Why a call now must run eagerly: a forward around it is collecting layers' outputs
    through hooks (``collector``, transformers' context variable); ``None`` when none is."""
    collected = collector.get()
    if not collected:
        return None
    names = sorted(name for name in collected if not name.startswith("_"))
    if not names:
        return None
    return (
        f"transformers is collecting {' and '.join(names)} through hooks on the layers, which "
        f"a replay would not run; calls without output_hidden_states and output_attentions are "
        f"served by the graphs"
    )


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
