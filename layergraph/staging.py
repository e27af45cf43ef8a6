"""A packed graph's per-call metadata, written on the host and sent to the device in one copy.

A packed plan writes each call's metadata (boundaries, positions, windows) into buffers its
graph reads. Written field by field from pageable host tensors, that is one synchronising
host-to-device copy per field. :class:`Staging` lays every field out in one byte buffer,
twice: in pinned host memory, where the plan writes a call's values with plain CPU operations,
and on the device, where the graph reads views of it; :meth:`Staging.send` copies the whole
buffer in one non-blocking transfer on the caller's stream, ordered before the replay that
reads it.

A host buffer may not be written again until its copy has run. Two host buffers are used in
turn, each with an event recorded after its copy; writing one waits for the copy made from it
two calls before, which a caller that waits for its results has long seen done. Off a GPU
(tests) the buffers are plain tensors and copies are immediate, through the same two-buffer
path.

What it does not do: know which fields a plan needs (the plan names them), or pad values (the
plan writes whole fields, padding included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["Staging"]

_ALIGN = 16
"""Bytes each field's offset is a multiple of, for any dtype's view."""


class Staging:
    """Named fields (dtype and shape) in one host-and-device buffer pair; see the module.

    :meth:`host` gives the host views to fill for one call, :meth:`send` transfers them;
    :attr:`device` holds the device views the graph reads, whose addresses never change.
    :attr:`sends` counts the transfers.
    """

    def __init__(
        self, fields: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device
    ) -> None:
        offsets, size = {}, 0
        for name, (dtype, shape) in fields.items():
            offsets[name] = size
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            size += -(-nbytes // _ALIGN) * _ALIGN
        self._fields = {name: (offsets[name], *spec) for name, spec in fields.items()}
        pinned = device.type == "cuda"
        self._hosts = [
            torch.zeros(max(size, 1), dtype=torch.uint8, pin_memory=pinned) for _ in range(2)
        ]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._bytes = torch.zeros(max(size, 1), dtype=torch.uint8, device=device)
        self.device = self._views(self._bytes)
        """The device views the graph reads, by field name."""
        self._host_views = [self._views(host) for host in self._hosts]
        self._turn = 0
        self.sends = 0

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (offset, dtype, shape) in self._fields.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            views[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
        return views

    def host(self) -> dict[str, torch.Tensor]:
        """The host views to write this call's values into (every field whole), once the copy
        made from this host buffer before has run."""
        event = self._events[self._turn]
        if event is not None and not event.query():
            event.synchronize()
        return self._host_views[self._turn]

    def send(self) -> None:
        """Copy the host buffer written since :meth:`host` to the device, without waiting, on
        the current stream; the next call writes the other host buffer."""
        host = self._hosts[self._turn]
        self._bytes.copy_(host, non_blocking=host.is_pinned())
        if self._bytes.is_cuda:
            event = self._events[self._turn] or torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        self._turn ^= 1
        self.sends += 1
