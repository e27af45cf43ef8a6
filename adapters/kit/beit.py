"""The plan of BEiT's and Data2Vec-Vision's towers: relative position biases a CUDA graph
can capture.

Their relative position bias modules index the bias table with an index built on the host
(a CPU tensor, cached per window size by transformers), so every call copies it to the
table's device, which a CUDA stream capture refuses. While wrapped, each such module reads its
index from a copy kept on the table's device, per window size and device: the same values,
no copy inside the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from layergraph.ledger import Change, ChangeLedger, SetAttribute
from layergraph_adapters.kit.hf_vision import VisionTowerPlan

__all__ = ["BeitPlan", "device_position_indices"]


def device_position_indices(tower: nn.Module) -> list[Change]:
    """One change per relative position bias module of ``tower`` (a module with a
    ``relative_position_bias_table`` and a ``generate_relative_position_index``): its index
    read from a copy on the table's device."""
    return [
        SetAttribute(
            module,
            "generate_relative_position_index",
            _kept_on_device(module),
            "relative position index kept on the bias table's device",
        )
        for module in tower.modules()
        if hasattr(module, "relative_position_bias_table")
        and hasattr(module, "generate_relative_position_index")
    ]


def _kept_on_device(module: nn.Module) -> Callable[[Any], torch.Tensor]:
    """``module``'s own index function, its answers copied to the table's device once per
    window size and device."""
    own = module.generate_relative_position_index  # static from 5.17, a method before
    kept: dict[tuple[Any, ...], torch.Tensor] = {}

    def index(window_size: Any) -> torch.Tensor:
        device = module.relative_position_bias_table.device
        key = (*tuple(window_size), device)
        if key not in kept:
            kept[key] = own(tuple(window_size)).to(device)
        return kept[key]

    return index


class BeitPlan(VisionTowerPlan):
    """A BEiT or Data2Vec-Vision tower's whole forward, its relative position indices kept on
    the device while wrapped (:func:`device_position_indices`)."""

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for change in device_position_indices(self.owner):
            changes.apply(change)
