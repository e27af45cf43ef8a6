"""The example model type: a model built from its configuration with random weights, and
inputs for it; what a plugin's ``example_model`` hook returns (:mod:`layergraph.bench.examples`
finds them). A leaf module: it imports nothing of layergraph."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ExampleModel"]


@dataclass(frozen=True)
class ExampleModel:
    """A model a plugin can build with random weights, and inputs for it.

    ``build(dtype, device)`` makes the model from its configuration, in eval mode;
    ``inputs(batch, dtype, device)`` returns the ``(args, kwargs)`` of one call with ``batch``
    random images. A model that takes every image at its own size (a native-resolution tower)
    also has ``sized_inputs``: ``sized_inputs(sizes, dtype, device)``, one call with random
    images of ``sizes`` (``(height, width)`` in pixels each), laid out and resized as the
    model's processor would; ``inputs`` is it with images of one size. A whole VLM also has
    ``prompt``: ``prompt(sizes, dtype, device)``, the keyword inputs of one prompt of a few
    random text tokens around images of ``sizes``, as its processor lays them out, for a
    prefill (``layergraph bench --prefill``).
    """

    name: str
    adapter: str
    build: Callable[[torch.dtype, torch.device], nn.Module]
    inputs: Callable[[int, torch.dtype, torch.device], tuple[tuple[Any, ...], dict[str, Any]]]
    sized_inputs: (
        Callable[
            [Sequence[tuple[int, int]], torch.dtype, torch.device],
            tuple[tuple[Any, ...], dict[str, Any]],
        ]
        | None
    ) = None
    prompt: (
        Callable[[Sequence[tuple[int, int]], torch.dtype, torch.device], dict[str, Any]] | None
    ) = None
    capturable: Callable[[nn.Module], AbstractContextManager[Any]] | None = None
    """``capturable(model)``: a context in which a CUDA stream can capture the model's own
    forward at all, for a hand-written graph (the changes layergraph makes for its capture,
    none of its speed options; Idefics' position ids without boolean-mask indexing), undone on
    leaving; ``None`` where the forward captures as it is."""
