"""Row-major hidden states: one copy where a tower's token sequence starts, none in its layers.

A ViT's patch embedding ends in ``flatten(2).transpose(1, 2)``, a column-major view of the
patch grid. Where the position embedding is then added (rather than a class token
concatenated), the sum keeps that order, and so does every residual add after it: each layer
norm and each projection of every layer copies its input before it can run. On an H200 those
copies took 15 % of SigLIP so400m's time at batch 32, and eager ran a quarter faster without
them. Making the embedding's output contiguous once removes them; the values do not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layergraph.ledger import AddForwardHook

__all__ = ["RowMajorOutput"]


class RowMajorOutput(AddForwardHook):
    """Makes ``module``'s tensor output row-major (``contiguous()``) while applied.

    A forward hook, registered by applying this change through the wrapper's ledger and
    removed by undoing it. An output that is row-major already is returned as it is, at no
    cost; outputs that are not tensors are not copied.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, _contiguous_output, "output made row-major")


def _contiguous_output(_: nn.Module, __: Any, output: Any) -> Any:
    return output.contiguous() if isinstance(output, torch.Tensor) else output
