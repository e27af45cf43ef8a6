"""The plan of a Q-Former: the second stack of BLIP-2, InstructBLIP and InstructBLIP-Video.

A Q-Former takes a batch of learnt queries (``query_embeds``, ``[images, queries, width]``)
and, in every other layer, attends across to the vision tower's tokens
(``encoder_hidden_states``); InstructBLIP's takes the instruction's tokens as well
(``input_ids`` and their ``attention_mask``), which attend together with the queries. Its
matrices are small (32 queries), so its forward is bound by kernel launches: its graphs are
keyed by images and (queries, image tokens, instruction tokens), and the measured policy serves
eagerly the sizes whose graphs do not pay.

Inside its model (``qformer``), the Q-Former's forward is routed to the graphs and the model's
own code calls it, as a vision tower's; the tower beside it is served by its own adapter under
the same wrapper (:mod:`layergraph.multi_tower`).

What this does not do: take other inputs than tensors (``query_length``) from the graphs.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from layergraph.keys import CallInputs
from layergraph_adapters.kit.hf_vision import VisionTowerPlan

__all__ = ["QFormerPlan", "QFormerTokens", "queries_and_image_tokens"]


class QFormerTokens(NamedTuple):
    """The sequence of a Q-Former's key: its queries, the image tokens it attends across to,
    and the instruction's tokens (0 for BLIP-2's)."""

    queries: int
    image_tokens: int
    instruction_tokens: int

    def __str__(self) -> str:
        text = f", {self.instruction_tokens} instruction tokens" if self.instruction_tokens else ""
        return f"{self.queries} queries over {self.image_tokens} image tokens{text}"


def queries_and_image_tokens(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """A Q-Former's inputs for ``batch`` images of a tower whose output has as many tokens as
    ``size`` (height, width) in patches of 14 and one class token: 32 random queries and
    random image tokens (and an instruction of 8 tokens, for InstructBLIP's)."""
    tokens = (size[0] // 14) * (size[1] // 14) + 1
    inputs: dict[str, Any] = {
        "query_embeds": torch.randn(batch, 32, config.hidden_size, dtype=dtype, device=device),
        "encoder_hidden_states": torch.randn(
            batch, tokens, config.encoder_hidden_size, dtype=dtype, device=device
        ),
    }
    if "instructblip" in config.model_type:
        inputs["input_ids"] = torch.randint(1, 100, (batch, 8), device=device)
    return inputs


class QFormerPlan(VisionTowerPlan):
    """A Q-Former's whole forward, keyed by (images, :class:`QFormerTokens`)."""

    def read_geometry(self, config: Any) -> None:
        self.width: int = config.hidden_size
        self.image_width: int = config.encoder_hidden_size
        parameters = inspect.signature(type(self.owner).forward).parameters
        self.positions = {name: index for index, name in enumerate(list(parameters)[1:])}
        """Each parameter's position in the forward (``input_ids`` first in InstructBLIP's)."""

    def argument(self, call: CallInputs, name: str) -> Any:
        """The call's argument ``name``, passed by position or keyword."""
        return call.argument(name, self.positions.get(name))

    def sequence_of(self, call: CallInputs) -> Hashable:
        images, text = (self.argument(call, n) for n in ("encoder_hidden_states", "input_ids"))
        return QFormerTokens(
            self.argument(call, "query_embeds").shape[1],
            images.shape[1] if isinstance(images, torch.Tensor) else 0,
            text.shape[1] if isinstance(text, torch.Tensor) else 0,
        )

    def check_inputs(self, call: CallInputs) -> None:
        name = type(self.owner).__name__
        queries = self.argument(call, "query_embeds")
        if not isinstance(queries, torch.Tensor) or queries.dim() != 3:
            shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else queries
            raise ValueError(
                f"{name} takes query_embeds of shape [images, queries, {self.width}], got {shape}"
            )
        if queries.shape[-1] != self.width:
            raise ValueError(
                f"expected query_embeds of width {self.width}, got {queries.shape[-1]}"
            )
        images = self.argument(call, "encoder_hidden_states")
        if isinstance(images, torch.Tensor) and images.shape[-1] != self.image_width:
            raise ValueError(
                f"expected encoder_hidden_states of width {self.image_width} (the vision "
                f"tower's), got {images.shape[-1]}"
            )
