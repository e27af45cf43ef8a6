"""Plugin for sentence-transformers models with an image tower: ``SentenceTransformer`` (CLIP,
SigLIP and the other models whose first module holds a transformers model that another adapter
serves).

Wrapping the ``SentenceTransformer`` routes the image tower of the transformers model inside it
to the graphs, through the adapter that serves that model (``clip`` for a ``CLIPModel``), so
that ``model.encode(images)`` embeds its images from the graphs; texts, and everything after the
tower (projection, pooling, normalisation modules), run eagerly. What this adapter does not do:
serve a module whose model no other adapter recognises, or one whose adapter would graph the
module's whole forward instead of routing a tower inside it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, PlanContext, hookimpl
from layergraph.plugins import UnknownAdapterError


def _is_sentence_transformer(model: object) -> bool:
    if "sentence_transformers" not in sys.modules:
        return False
    from sentence_transformers import SentenceTransformer

    return isinstance(model, SentenceTransformer)


def _inner_model(model: nn.Module) -> nn.Module | None:
    """The transformers model held by the first module of ``model`` that takes images."""
    for module in model.children():
        inner = getattr(module, "model", None)
        if isinstance(inner, nn.Module) and "image" in getattr(module, "modalities", ()):
            return inner
    return None


class SentenceTransformersAdapter(Adapter):
    """Graphs the image tower inside a ``SentenceTransformer`` (the module's text says how).

    Options given to ``wrap`` go to the adapter of the model inside, for example
    ``attention="sdpa"``.
    """

    name = "sentence_transformers"

    def __init__(self, **options: Any) -> None:
        self.options = options

    def recognizes(self, model: nn.Module) -> bool:
        return _is_sentence_transformer(model) and _inner_model(model) is not None

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        inner = _inner_model(model) if _is_sentence_transformer(model) else None
        if inner is None:
            raise AdapterMismatch(
                f"the sentence_transformers adapter serves a SentenceTransformer with a module "
                f"that takes images (a CLIP model, say); got {type(model).__module__}."
                f"{type(model).__name__}"
            )
        try:
            adapter, plan = context.plan_part(inner, self.options)
        except UnknownAdapterError as error:
            raise AdapterMismatch(
                f"this SentenceTransformer holds a {type(inner).__name__}, which no adapter "
                f"recognises ({error})"
            ) from error
        if plan.serves_forward:
            raise AdapterMismatch(
                f"the {adapter.name!r} adapter graphs the whole forward of this "
                f"SentenceTransformer's {type(inner).__name__} rather than routing a tower "
                f"inside it, which its sentence-transformers module does not call as a forward"
            )
        return plan


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(SentenceTransformersAdapter)
