"""A layer that makes a tensor on the host in its forward and uses it on the device, for the
tests of captures refused at a copy from the host (CPU and CUDA alike)."""

from __future__ import annotations

import torch
from torch import nn


class IndexedOnHost(nn.Module):
    """Scales each row of ``x`` by a weight's row, picked with an index made on the host during
    the forward: by ``torch.arange`` without ``device=`` (as SAM ViT's relative positions are),
    or by ``torch.tensor`` of Python's numbers (values a capture cannot make on the device).
    Eagerly PyTorch copies the index to the device; a capture refuses the copy from pageable
    host memory."""

    def __init__(self, made_with: str, width: int) -> None:
        super().__init__()
        self.made_with = made_with
        self.weight = nn.Parameter(torch.randn(16, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.made_with == "arange":
            index = torch.arange(rows)
        else:
            index = torch.tensor(list(range(rows)))
        return x * self.weight[index]
