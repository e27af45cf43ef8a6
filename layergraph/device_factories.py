"""Tensors that captured code makes without a device, made on the capture's device instead.

A model may build a small tensor on the host in its forward (``torch.arange(n)`` without
``device=``, then index a weight by it, or ``.to(x.device)``): eagerly, PyTorch copies it to
the GPU; under a CUDA stream capture the copy from pageable host memory is refused ("Cannot
copy between CPU and CUDA tensors during CUDA graph capture"). A capture that fails so is
tried again under :class:`MadeOnDevice`, which makes such tensors on the device with a kernel
of their own, as Inductor does: no copy, the same values.

Only factories that compute their values are moved; ``torch.tensor(data)`` and
``torch.as_tensor(data)`` hold values from Python and stay where the code made them (moving
them would be a copy again), and random factories stay too (a random stream of another device
would give other numbers than eager).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["COMPUTED_FACTORIES", "HOST_COPY_MESSAGE", "MadeOnDevice", "copies_from_host"]

COMPUTED_FACTORIES = frozenset(
    {
        torch.arange,
        torch.empty,
        torch.empty_strided,
        torch.eye,
        torch.full,
        torch.linspace,
        torch.logspace,
        torch.ones,
        torch.tril_indices,
        torch.triu_indices,
        torch.zeros,
    }
)
"""Factories whose values a kernel computes from their arguments alone."""

HOST_COPY_MESSAGE = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
"""What a capture's error says where it copied from pageable host memory (PyTorch's words,
which :class:`~layergraph.testing.SimulatedGraphs` repeats)."""


class MadeOnDevice(TorchFunctionMode):
    """Within, :data:`COMPUTED_FACTORIES` called without ``device=`` make their tensor on
    ``device`` (a tensor asked for in pinned host memory stays there); every other call runs
    as it was made."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func in COMPUTED_FACTORIES
            and kwargs.get("device") is None
            and not kwargs.get("pin_memory")
        ):
            kwargs = {**kwargs, "device": self.device}
        return func(*args, **kwargs)


def copies_from_host(error: BaseException | None) -> bool:
    """Whether ``error``, a capture's, is a copy of a tensor from pageable host memory to the
    device: a capture that :class:`MadeOnDevice` may let through."""
    while error is not None:
        if HOST_COPY_MESSAGE in str(error):
            return True
        error = error.__cause__
    return False
