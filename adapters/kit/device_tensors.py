"""Tensors a tower keeps or makes on the host, put on its device while wrapped.

Some towers hold a tensor as a plain attribute rather than a buffer (VideoMAE's sinusoidal
position table), so moving the model leaves it on the host and every call copies it to the
device; others build an index on the host at every call (SAM's relative positions,
``torch.arange`` without a device). A CUDA stream capture refuses both copies. The changes
here keep the values and move the work to the device: a plain tensor attribute becomes a
non-persistent buffer for as long as the model is wrapped (it then moves with the model, and
``state_dict`` does not change), and SAM's relative positions are gathered with an index made
on the device.

What this does not do: find such tensors by itself in a family it was not written for; a
family's plan applies these where its forward needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layergraph.ledger import Change, ChangeLedger, SetAttribute
from layergraph_adapters.kit.hf_vision import VisionTowerPlan

__all__ = [
    "SamPlan",
    "TensorAttributeAsBuffer",
    "device_relative_positions",
    "tensor_attributes",
]


class TensorAttributeAsBuffer(Change):
    """Makes ``module``'s plain tensor attribute ``name`` a non-persistent buffer, on the
    device of the module's parameters (or of the tower's, ``device``); undo restores the
    attribute as it was."""

    def __init__(self, module: nn.Module, name: str, device: torch.device) -> None:
        value = module.__dict__.get(name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{type(module).__name__}.{name} is not a plain tensor attribute")
        self.target, self._module, self.name = module, module, name
        self._value, self._device = value, device
        self.what = f"{name} kept as a buffer on the model's device"

    def apply(self) -> None:
        del self._module.__dict__[self.name]
        self._module.register_buffer(self.name, self._value.to(self._device), persistent=False)

    def undo(self) -> None:
        del self._module._buffers[self.name]
        self._module.__dict__[self.name] = self._value


def tensor_attributes(tower: nn.Module) -> list[Change]:
    """One :class:`TensorAttributeAsBuffer` per plain tensor attribute of ``tower``'s
    modules, each put on the device of ``tower``'s parameters."""
    parameter = next(tower.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return [
        TensorAttributeAsBuffer(module, name, device)
        for module in tower.modules()
        for name, value in list(vars(module).items())
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]


def device_relative_positions(tower: nn.Module) -> list[Change]:
    """One change per SAM attention module of ``tower`` (a module with ``get_rel_pos`` and
    ``use_rel_pos``): its relative positions gathered with an index made on their device."""
    return [
        SetAttribute(
            module,
            "get_rel_pos",
            _relative_positions,
            "relative positions gathered by an index made on the device",
        )
        for module in tower.modules()
        if hasattr(module, "get_rel_pos") and hasattr(module, "use_rel_pos")
    ]


def _relative_positions(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    """SAM's ``get_rel_pos``: the embeddings of the relative positions of ``q_size`` queries
    and ``k_size`` keys, ``rel_pos`` resized to them; the coordinates made on ``rel_pos``'s
    device."""
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    resized = F.interpolate(
        rel_pos.reshape(1, rel_pos.shape[0], -1).transpose(1, 2), size=max_rel_dist, mode="linear"
    )
    resized = resized.reshape(-1, max_rel_dist).permute(1, 0)
    device = rel_pos.device
    q_coords = torch.arange(q_size, device=device)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size, device=device)[None, :] * max(q_size / k_size, 1.0)
    relative = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return resized[relative.long()]


class SamPlan(VisionTowerPlan):
    """A SAM or SAM-HQ image encoder's whole forward, its relative positions gathered on the
    device while wrapped (:func:`device_relative_positions`)."""

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for change in device_relative_positions(self.owner):
            changes.apply(change)
