"""A layergraph adapter for transformers' ``Dinov2Model``, shipped as its own package.

layergraph serves DINOv2 itself (its ``dinov2`` adapter, one entry of its table of towers);
this package writes an adapter for it by hand, as a plugin of its own, under the name
``dinov2-example``, to show every part an adapter has. The whole forward is captured per
(batch, tokens): patch embedding, the position embedding interpolated to the image size, the
layers and the final norm. With ``patch_matmul=True`` the patch convolution runs as one matrix
product, a change made to the model through the wrapper's ledger and undone by ``unwrap()``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

import layergraph
from layergraph.bench.examples import ExampleModel
from layergraph.keys import CallInputs
from layergraph_adapters.kit.patch_embedding import PatchMatmul


class Dinov2Adapter(layergraph.Adapter):
    """Graphs a transformers ``Dinov2Model``."""

    name = "dinov2-example"

    def __init__(self, patch_matmul: bool = False) -> None:
        self.patch_matmul = patch_matmul

    def recognizes(self, model: nn.Module) -> bool:
        if "transformers" not in sys.modules:  # never import what the user did not
            return False
        from transformers import Dinov2Model

        return isinstance(model, Dinov2Model)

    def plan(self, model: nn.Module, context: layergraph.PlanContext) -> layergraph.CapturePlan:
        from transformers import Dinov2Model

        if not isinstance(model, Dinov2Model):
            raise layergraph.AdapterMismatch(
                f"the {self.name} adapter serves transformers' Dinov2Model, got "
                f"{type(model).__name__}"
            )
        return Dinov2Plan(model, patch_matmul=self.patch_matmul)


class Dinov2Plan(layergraph.WholeForward):
    """The model's whole forward; the key's sequence is the token count."""

    def __init__(self, model: nn.Module, patch_matmul: bool) -> None:
        super().__init__(model)
        convolution = model.embeddings.patch_embeddings.projection
        self._rewrites = [PatchMatmul(convolution)] if patch_matmul else []

    def change_model(self, changes: layergraph.ChangeLedger, serve: Callable[..., Any]) -> None:
        for rewrite in self._rewrites:  # each undone by unwrap(), newest first
            changes.apply(rewrite)

    def sequence_of(self, call: CallInputs) -> Hashable:
        patch = self.owner.config.patch_size
        height, width = call.tensors[0].shape[-2:]
        return (height // patch) * (width // patch) + 1

    def check_inputs(self, call: CallInputs) -> None:
        pixels = call.tensors[0]
        if pixels.dim() != 4 or pixels.shape[1] != self.owner.config.num_channels:
            raise ValueError(
                f"expected pixel_values of shape [batch, {self.owner.config.num_channels}, "
                f"height, width], got {tuple(pixels.shape)}"
            )


@layergraph.hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(Dinov2Adapter)


@layergraph.hookimpl
def example_model(name: str) -> ExampleModel | None:
    """A DINOv2-S with random weights, for ``layergraph bench --model dinov2-small``."""
    if name != "dinov2-small":
        return None

    def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6)
        with torch.device(device):
            return Dinov2Model(config).to(dtype).eval()

    def inputs(batch: int, dtype: torch.dtype, device: torch.device) -> Any:
        return (torch.randn(batch, 3, 224, 224, dtype=dtype, device=device),), {}

    return ExampleModel(name, Dinov2Adapter.name, build, inputs)


@layergraph.hookimpl
def example_model_names() -> list[str]:
    return ["dinov2-small"]
