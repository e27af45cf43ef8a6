"""Plugin for InternViT, the vision tower of InternVL, from transformers.

Serves ``InternVLVisionModel`` (InternViT-300M, InternViT-6B and their configurations) and the
vision tower inside ``InternVLModel`` and ``InternVLForConditionalGeneration``. The tower's
whole forward (patch embedding, position embedding, layers, final norm) is captured per key
(batch of tiles, tokens per tile): 1025 tokens for a 448x448 tile. Wrapping a VLM graphs its
tower in place, so ``generate()`` and ``get_image_features()`` use the graphs; ``unwrap()``
restores the tower.

Each attention module computes q, k and v as usual and hands them, packed as
``[tokens, heads, head_dim]`` views of the projections, to the attention backend chosen with
``attention=``: ``sdpa`` (dense), ``triton`` (layergraph's varlen kernel, writing into a
per-key workspace), ``fa3`` (FA3 or PyTorch's varlen flash kernel), any backend a plugin
registers through the ``register_attention_backends`` hook, or ``auto`` (the fastest here,
measured). Attention metadata comes from the ``attention_metadata`` hook, once per key.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layergraph import AdapterMismatch, PlanContext, ShapeKey, hookimpl
from layergraph.attention import (
    AttentionBackend,
    AttentionMetadata,
    SequenceLayout,
    choose_backend,
)
from layergraph.attention.opaque import opaque_attention, register_route
from layergraph.keys import CallInputs
from layergraph_adapters.kit.automatic import SpeedChoices, build_with_automatic_options
from layergraph_adapters.kit.fused_norm import SCALED_LAYER
from layergraph_adapters.kit.fused_qkv import FusedQKV
from layergraph_adapters.kit.hf_vision import VisionTowerAdapter, VisionTowerPlan, pixels_of
from layergraph_adapters.kit.tower_specs import TowerSpec, build_tower

INTERNVIT_CONFIGS: dict[str, dict[str, Any]] = {
    "internvit-300m": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=[448, 448],
        patch_size=[14, 14],
        norm_type="layer_norm",
        use_qk_norm=False,
    ),
    "internvit-6b": dict(
        hidden_size=3200,
        intermediate_size=12800,
        num_hidden_layers=45,
        num_attention_heads=25,
        image_size=[448, 448],
        patch_size=[14, 14],
        norm_type="rms_norm",
        use_qk_norm=True,
    ),
}
"""``InternVLVisionConfig`` settings of InternViT-300M and InternViT-6B at 448x448 tiles, for
building the towers with random weights (tests, benchmarks) without downloading anything."""


def build_internvit(name: str, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """An ``InternVLVisionModel`` of one of :data:`INTERNVIT_CONFIGS`, random weights, eval mode."""
    return build_tower("InternVLVisionModel", INTERNVIT_CONFIGS[name], dtype, device)


@dataclass(frozen=True)
class AttentionState:
    """What every attention module of the tower uses for one key: backend, metadata, workspace."""

    backend: AttentionBackend
    layout: SequenceLayout
    metadata: AttentionMetadata
    workspace: torch.Tensor | None


_current_state: contextvars.ContextVar[AttentionState | None] = contextvars.ContextVar(
    "layergraph_internvl_attention", default=None
)


class InternViTPlan(VisionTowerPlan):
    """The tower's whole forward, keyed by (tiles, tokens per tile), with routed attention."""

    attention_routing = "q, k and v handed to the chosen attention backend"
    routes_attention = True

    def __init__(
        self,
        tower: nn.Module,
        spec: TowerSpec,
        *,
        attention: str,
        context: PlanContext,
        feature_layers: int | list[int] | None = None,
        choices: SpeedChoices,
    ) -> None:
        config = tower.config
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int) or heads < 1:
            raise AdapterMismatch(
                "the internvl adapter sizes its attention workspace from the vision config's "
                "num_attention_heads, which this model's config does not give"
            )
        if config.hidden_size % heads:
            raise AdapterMismatch(
                f"hidden_size {config.hidden_size} is not a multiple of {heads} heads"
            )
        super().__init__(tower, spec, feature_layers=feature_layers, choices=choices)
        names = (*context.registry.attention_backend_names(), "auto")
        if attention not in names:
            raise ValueError(f"attention={attention!r}: choose one of {', '.join(names)}")
        self.attention = attention
        self._registry = context.registry
        self.head_dim = config.hidden_size // heads
        self.heads = _local_rows(tower.encoder.layer[0].attention.q_proj.weight) // self.head_dim
        """Heads this process computes: all of them, or its share under tensor parallelism."""
        self.attention_by_key: dict[ShapeKey, str] = {}
        """Which backend, and which implementation of it, serves each captured key."""
        self._eager_states: OrderedDict[tuple[Any, ...], AttentionState] = OrderedDict()

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if _current_state.get() is not None or kwargs.get("output_attentions"):
            return super().region(*args, **kwargs)
        pixels = pixels_of(args, kwargs)
        tokens = self.image_tokens(*pixels.shape[-2:]).tokens
        state = self._eager_state(pixels.shape[0], tokens, pixels.device, self._dtype())
        with self.bound(state):
            return super().region(*args, **kwargs)

    def key_state(self, key: ShapeKey, call: CallInputs) -> AttentionState:
        pixels = call.tensors[0]
        state = self._build_state(key.batch, key.sequence.tokens, pixels.device, self._dtype())
        self.attention_by_key[key] = f"{state.backend.name} ({state.backend.implementation})"
        return state

    @contextlib.contextmanager
    def bound(self, state: AttentionState | None) -> Iterator[None]:
        token = _current_state.set(state)
        try:
            yield
        finally:
            _current_state.reset(token)

    def routed_attention(self, index: int, module: nn.Module) -> Callable[..., Any]:
        return _routed_attention(module, self.fusions[index] if self.fusions else None)

    # ---- attention state ---------------------------------------------------------------------

    def _dtype(self) -> torch.dtype:
        return self._attentions[0].q_proj.weight.dtype

    def _build_state(
        self, batch: int, tokens: int, device: torch.device, dtype: torch.dtype
    ) -> AttentionState:
        layout = SequenceLayout.uniform(batch, tokens)
        backend = choose_backend(
            self.attention,
            device,
            dtype,
            self.heads,
            self.head_dim,
            layout,
            backends=self._registry.attention_backends(),
        )
        metadata = self._registry.attention_metadata(
            backend=backend.name, layout=layout, device=device
        )
        workspace = (
            torch.empty(layout.total, self.heads, self.head_dim, dtype=dtype, device=device)
            if backend.needs_workspace
            else None
        )
        return AttentionState(backend, layout, metadata, workspace)

    def _eager_state(
        self, batch: int, tokens: int, device: torch.device, dtype: torch.dtype
    ) -> AttentionState:
        """States for eager calls, kept for the last few (batch, tokens) seen."""
        lookup = (batch, tokens, device, dtype)
        state = self._eager_states.get(lookup)
        if state is None:
            state = self._build_state(batch, tokens, device, dtype)
            self._eager_states[lookup] = state
            if len(self._eager_states) > 8:
                self._eager_states.popitem(last=False)
        else:
            self._eager_states.move_to_end(lookup)
        return state


def _local_rows(weight: torch.Tensor) -> int:
    """Rows of ``weight`` held here: all of them, or a tensor-parallel shard's."""
    return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]


_ROUTE = "internvl"
"""The routed attention's name for :func:`~layergraph.attention.opaque.opaque_attention`."""


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k and v handed to the backend of the state bound now, with its layout, metadata and
    workspace (run at run time, opaque to ``torch.compile``)."""
    state = _current_state.get()
    if state is None:
        raise RuntimeError("InternVL's routed attention ran with no state bound")
    if not state.backend.takes_strided_inputs:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return state.backend(
        q,
        k,
        v,
        layout=state.layout,
        metadata=state.metadata,
        workspace=state.workspace,
        scale=scale,
    )


register_route(_ROUTE, _attend)


def _routed_attention(module: nn.Module, fused: FusedQKV | None) -> Callable[..., Any]:
    """A forward for one ``InternVLVisionAttention`` that hands q, k, v to the bound backend.

    With ``fused``, q, k and v come from one matrix product, as strided views of its output.
    Outside a bound state (attention weights asked for, or the module called on its own) the
    module's own forward runs.
    """
    original = type(module).forward.__get__(module)

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = _current_state.get()
        if state is None:
            return original(hidden_states, *args, **kwargs)
        batch, tokens, _ = hidden_states.shape
        head_dim = module.head_dim
        if fused is None:
            q = module.q_proj(hidden_states)
            k = module.k_proj(hidden_states)
            v = module.v_proj(hidden_states)
        else:
            width = fused.weight.shape[0] // 3
            q, k, v = F.linear(hidden_states, fused.weight, fused.bias).split(width, dim=-1)
        local_width = q.shape[-1]  # all heads, or this rank's share under tensor parallelism
        shape = (batch * tokens, local_width // head_dim, head_dim)
        q, k, v = module.q_norm(q).view(shape), module.k_norm(k).view(shape), v.view(shape)
        out = opaque_attention(q, k, v, _ROUTE, module.scale)
        out = module.projection_layer(out.view(batch, tokens, local_width))
        return module.projection_dropout(out), None

    return forward


INTERNVL = TowerSpec(
    adapter="internvl",
    classes=("InternVLVisionModel",),
    casts_pixels=True,
    family="InternViT",
    layers=("encoder.layer",),
    attention="attention",
    prefix_tokens=1,
    image_sizes="any",  # the position embedding is interpolated to any tile size
    layer_form=SCALED_LAYER,
    plan=InternViTPlan,
)
"""InternViT: the class token; attention routed to the chosen backend by
:class:`InternViTPlan`, which fuses q, k and v there with ``fuse_qkv``."""


class InternVLAdapter(VisionTowerAdapter):
    """Graphs InternViT, alone or as the vision tower of an InternVL model."""

    name = "internvl"
    spec = INTERNVL

    def __init__(
        self,
        attention: str = "auto",
        feature_layers: int | list[int] | None = None,
        fuse_qkv: bool | str = "auto",
        patch_matmul: bool | str = "auto",
        fuse_gelu: bool | str = "auto",
        fuse_norm: bool | str = "auto",
    ) -> None:
        super().__init__(feature_layers, fuse_qkv, patch_matmul, fuse_gelu, fuse_norm)
        self.attention = attention

    def make_plan(
        self, tower: nn.Module, feature_layers: int | list[int] | None, context: PlanContext
    ) -> VisionTowerPlan:
        return build_with_automatic_options(
            tower,
            self.rewrite_options(),
            functools.partial(
                InternViTPlan,
                tower,
                self.spec,
                attention=self.attention,
                context=context,
                feature_layers=feature_layers,
            ),
            context,
            self.spec.ruled_out(),
        )


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(InternVLAdapter)
