"""Plugin for the packed vision towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and Qwen3-VL-MoE),
Qwen3.5 and GLM, from transformers.

Serves ``Qwen2VisionTransformerPretrainedModel``, ``Qwen2_5_VisionTransformerPretrainedModel``,
``Qwen3VLVisionModel`` (and ``Qwen3VLMoeVisionModel``, Qwen3-VL-MoE's copy of it), Qwen3.5's
towers (``Qwen3_5VisionModel``, ``Qwen3_5MoeVisionModel``) and GLM's towers
(``Glm4vVisionModel``: GLM-4.1V and GLM-4.6V; ``Glm4vMoeVisionModel``: GLM-4.5V;
``GlmOcrVisionModel``; ``Glm5NextVisionModel``), alone or inside their VLMs (the ``...Model``
classes at ``visual``, the ``...ForConditionalGeneration`` classes at ``model.visual``). A tower
takes every image and video at its own resolution: the patches of all of a call's entries
(``grid_thw``) are packed into one sequence, attention is block-diagonal per frame (Qwen2-VL,
Qwen3-VL, Qwen3.5, GLM: in every layer; Qwen2.5-VL: in its full-attention layers, per window in
the others), and a patch merger closes the stack (GLM's after a downsampling convolution);
Qwen3-VL and Qwen3.5 also add a learned position table interpolated to each grid, and Qwen3-VL
returns deep-stack features (intermediate layers, each through its own merger; Qwen3.5's tower
has none). GLM-4.1V's and GLM-4.5V's towers add a learned position table resampled to each
frame's height and width (bicubic ``grid_sample``), which their forward computes on the device
from the frame boundaries, the rotary positions and ``grid_thw``'s rows, all given to the graph
in the budget's buffers; GLM-OCR's and GLM-5-Next's normalise q and k per head. Wrapping a VLM
graphs its tower in place, so ``generate()``, ``get_image_features()`` and
``get_video_features()`` use the graphs; ``unwrap()`` restores it.

Graphs are captured per token budget (:mod:`layergraph.packing`). On the host, each call's frame
boundaries (``cu_seqlens``), rotary positions (``position_ids``), for Qwen2.5-VL windows
(``cu_window_seqlens``, ``window_index``) and for Qwen3-VL the position table's rows and weights
per patch (``interp_indices``, ``interp_weights``; Qwen3.5's too) are computed by transformers'
own ``vision_utils`` and written, padded, into the budget's buffers, which the tower's forward
takes as precomputed arguments (transformers 5.17 and later: :data:`QWEN_SUPPORT`,
:data:`GLM_SUPPORT`, :data:`QWEN3_5_SUPPORT`, :data:`QWEN3_VL_MOE_SUPPORT`); for GLM-4.1V's and
GLM-4.5V's towers ``grid_thw``'s rows are written too, one slot per frame. Padding tokens come
last in every order (``window_index`` maps them to themselves), read no position table row (zero
weights) and belong to no frame or window: the sequences past the real ones are empty. Each
attention module hands q, k and v to a backend that reads the boundaries from those buffers when
it runs: ``sdpa_varlen`` (a block-diagonal mask, off the GPU), ``triton`` (layergraph's varlen
kernel, its grid bounded by the budget and by a window's tokens) or ``fa3``. With
``attention="auto"`` the full-attention and the windowed layers each get the backend timed
fastest on the frames and windows of the call that made the budget, in the budget's room.

Calls served eagerly (above every budget, a budget whose graph was measured slower, training,
...) run the tower's own forward with its own attention, as the unwrapped tower would: the
attention modules hand q, k and v to a backend only while a budget's buffers are bound (warm-up,
capture, replays), and the host metadata above is computed only for calls a graph serves.

What it does not serve from graphs (they run eagerly, the reason counted): attention weights
or hidden states asked for, precomputed arguments given by the caller, and for GLM-4.1V's and
GLM-4.5V's towers an entry of several frames (their forward reads ``grid_thw``'s rows by frame
index; their VLMs pass a video as one row per frame). GLM-Image's tower
(``GlmImageVisionModel``: no rotary positions, no merger) is not served.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from layergraph import PlanContext, hookimpl
from layergraph.attention import AttentionBackend, AttentionMetadata
from layergraph.attention.opaque import opaque_attention, register_route
from layergraph.keys import UnsupportedCall
from layergraph.ledger import ChangeLedger
from layergraph.packing import PackedCall
from layergraph_adapters.kit.aligned_mlp import AlignedForward, AlignedMLP
from layergraph_adapters.kit.automatic import SpeedChoices
from layergraph_adapters.kit.budget_buffers import BudgetBuffers, StagedField, StagedMetadata
from layergraph_adapters.kit.fused_norm import BLOCK, LayerForm, fused_norms
from layergraph_adapters.kit.fused_rotary import FusedRotary
from layergraph_adapters.kit.gelu_epilogue import gelu_epilogues
from layergraph_adapters.kit.grid_metadata import GridMetadata, GridMetadataCache
from layergraph_adapters.kit.packed_tower import (
    PackedFamily,
    PackedTowerAdapter,
    PackedTowerPlan,
    bound_buffers,
    copy_boundaries,
    image_slots,
    workspace,
)
from layergraph_adapters.kit.patch_embedding import packed_patch_matmul_for
from layergraph_adapters.kit.position_resampling import resampled_positions_for
from layergraph_adapters.kit.tower_specs import TEXT_ONLY_ARGUMENTS
from layergraph_adapters.kit.versions import Support

_VLM_PATHS = ("visual", "model.visual")
"""Where the VLMs of a served tower's modeling module hold it."""


_ATTEND = ("layergraph_adapters.qwen2_vl:Qwen2VLPlan.attend_packed",)

QWEN_SUPPORT = Support(
    "qwen2_vl",
    ">=5.17.0,<5.25",
    copies=_ATTEND,
    probes=(),
    tests=(
        "tests/test_qwen2_vl_adapter.py",
        "tests/test_qwen2_vl_eager.py",
        "tests/test_qwen2_vl_fused_norm.py",
        "tests/test_packed_attention_plugins.py",
    ),
)
"""5.17.0 to 5.24.x: the towers' forwards take the precomputed boundaries, positions and
windows from 5.17 on, computed by ``transformers.vision_utils``, which older releases lack."""
GLM_SUPPORT = Support("glm vision", ">=5.17.0,<5.25", _ATTEND, (), ("tests/test_glm4v_adapter.py",))
"""GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR and GLM-5-Next (the last two from later releases than
5.17): the Qwen towers' precomputed arguments; GLM-4.1V's also reads ``grid_thw``'s rows."""
QWEN3_5_SUPPORT = Support(
    "qwen3.5 vision", ">=5.17.0,<5.25", _ATTEND, (), ("tests/test_qwen3_5_adapter.py",)
)
"""Qwen3.5's towers: Qwen3-VL's without the deep-stack mergers."""
QWEN3_VL_MOE_SUPPORT = Support(
    "qwen3-vl-moe vision", ">=5.17.0,<5.25", _ATTEND, (), ("tests/test_qwen3_vl_moe_adapter.py",)
)
"""Qwen3-VL-MoE's tower: Qwen3-VL's renamed, called by its VLM as Qwen3-VL's is."""
QWEN_OMNI_SUPPORT = Support(
    "qwen omni vision", ">=5.17.0,<5.25", _ATTEND, (), ("tests/test_qwen_omni_adapter.py",)
)
"""The vision encoders of Qwen2.5-Omni's and Qwen3-Omni's thinkers: Qwen2.5-VL's and
Qwen3-VL's towers renamed, held as ``visual`` by the thinker."""


@dataclass(frozen=True)
class _TowerKind(PackedFamily):
    """A served tower class and what its forward computes from ``grid_thw`` besides frame
    boundaries and rotary positions."""

    holders: dict[str, tuple[str, ...]] = None  # type: ignore[assignment]
    layers: str = "blocks"
    attention: str = "attn"
    layer_form: LayerForm | None = field(default=BLOCK, compare=False, kw_only=True)
    support: Support | None = field(default=QWEN_SUPPORT, compare=False, kw_only=True)
    windows: bool = False
    """Whether some layers attend per window (``window_index``, ``cu_window_seqlens``)."""
    learned_positions: bool = False
    """Whether a learned position table is interpolated to each grid (``interp_indices``,
    ``interp_weights``: the table's rows each patch reads and their weights)."""
    grid_rows: bool = False
    """Whether the forward reads ``grid_thw`` on the device, one row per frame (GLM-4.1V's
    learned position table, resampled with ``grid_sample`` (which ``positions_matmul``
    replaces) to the height and width of the row
    ``grid_thw[frame]``): the graph is given the call's rows in a buffer of one slot per frame
    (:attr:`QwenBuffers.grid_thw`), and a call with an entry of several frames, whose rows
    the forward reads by frame index, runs eagerly."""
    qk_norms: bool = False
    """Whether attention normalises q and k per head (``q_norm``, ``k_norm``) before rotating
    them."""
    separate_qkv: bool = False
    """Whether attention projects q, k and v by three modules (``q``, ``k``, ``v``:
    Qwen2.5-Omni's) rather than one (``qkv``)."""
    other_holders: tuple[str, ...] = ()
    """Other modeling modules whose VLMs hold this tower at ``visual`` or ``model.visual``."""

    def ruled_out(self) -> dict[str, str]:
        """:meth:`PackedFamily.ruled_out`, and ``positions_matmul`` for a tower whose
        embeddings do not resample a learned table with ``grid_sample`` (all but GLM-4.1V's
        and GLM-4.5V's)."""
        found = super().ruled_out()
        if not self.grid_rows:
            found["positions_matmul"] = (
                f"positions_matmul is not available for {self.name}: it resamples no learned "
                "position table with grid_sample (the GLM-4.1V and GLM-4.5V towers do)"
            )
        return found

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.holders is None:
            modules = (self.module, *self.other_holders)
            object.__setattr__(self, "holders", dict.fromkeys(modules, _VLM_PATHS))


def _kind(package: str, name: str, **fields: Any) -> _TowerKind:
    """The tower class ``name`` of transformers' model package ``package``."""
    return _TowerKind(f"transformers.models.{package}.modeling_{package}", name, **fields)


def _glm(package: str, name: str, **fields: Any) -> _TowerKind:
    """A GLM vision tower: full attention per frame, a downsampling convolution and a merger
    at the end (:data:`GLM_SUPPORT`)."""
    return _kind(package, name, support=GLM_SUPPORT, **fields)


_LEARNED = dict(learned_positions=True)
"""The record fields of a tower with a learned position table."""
_TOWERS = (
    _kind("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    _kind("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel", windows=True),
    _kind("qwen3_vl", "Qwen3VLVisionModel", **_LEARNED),
    _kind("qwen3_vl_moe", "Qwen3VLMoeVisionModel", **_LEARNED, support=QWEN3_VL_MOE_SUPPORT),
    _kind("qwen3_5", "Qwen3_5VisionModel", **_LEARNED, support=QWEN3_5_SUPPORT),
    _kind("qwen3_5_moe", "Qwen3_5MoeVisionModel", **_LEARNED, support=QWEN3_5_SUPPORT),
    _kind(
        "qwen2_5_omni",
        "Qwen2_5OmniVisionEncoder",
        windows=True,
        separate_qkv=True,
        support=QWEN_OMNI_SUPPORT,
    ),
    _kind("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder", **_LEARNED, support=QWEN_OMNI_SUPPORT),
    _glm(
        "glm4v",
        "Glm4vVisionModel",
        grid_rows=True,
        other_holders=("transformers.models.glm46v.modeling_glm46v",),
    ),
    _glm("glm4v_moe", "Glm4vMoeVisionModel", grid_rows=True),
    _glm("glm_ocr", "GlmOcrVisionModel", qk_norms=True),
    _glm("glm5_next", "Glm5NextVisionModel", qk_norms=True),
)
_PRECOMPUTED = (
    "position_ids",
    "cu_seqlens",
    "max_seqlen",
    "window_index",
    "cu_window_seqlens",
    "max_window_seqlen",
    "interp_indices",
    "interp_weights",
)
"""The tower's arguments that replace what it computes from ``grid_thw``."""
_STAGED_ARGUMENTS = ("position_ids", "window_index", "interp_indices", "interp_weights")
"""Those the graph reads as staged (the boundaries reach it through the attention metadata)."""


@dataclass(frozen=True, eq=False)
class _Windows:
    """A budget's windowed layers' metadata and backend, chosen apart from the full-attention
    layers'."""

    metadata: AttentionMetadata
    backend: AttentionBackend


@dataclass(eq=False)
class QwenBuffers(BudgetBuffers):
    """One budget's buffers: besides the kit's, the tower's precomputed arguments (positions,
    window order, position table rows and weights), staged
    (:attr:`Qwen2VLPlan.staged_fields`), as are the boundaries the attention metadata is
    copied from. :attr:`metadata` is the full-attention layers' (its ``cu_seqlens`` is the
    tower's ``cu_seqlens``, frame boundaries), and :attr:`workspace` is shared by both kinds of
    attention."""

    grid_thw: torch.Tensor
    """The tower's ``grid_thw`` argument. A tower that reads it in the graph (GLM-4.1V's,
    :attr:`_TowerKind.grid_rows`) gets the call's rows, one slot per frame and one more, the
    row the padding tokens read (they belong to no frame), ``(1, 1, 1)`` past the real rows;
    for the others it is one row of zeros, which their forwards read only to compute what
    they are given precomputed."""
    window: _Windows | None
    """``None`` for a tower without windows."""
    fixed: dict[str, Any]
    """The call's other arguments (part of the signature)."""
    filled: int = 0
    """The rows of :attr:`pixels` the last call wrote (the rest are zeros)."""


def _grid_beside_pixels(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments with ``grid_thw`` on the device of ``hidden_states``, for the tower's
    own forward, which computes positions from the grid beside the pixels. Graphs read a grid
    on the host without a copy; an eager call copies it over."""
    pixels = kwargs.get("hidden_states", args[0] if args else None)
    in_args = "grid_thw" not in kwargs and len(args) > 1
    grid = args[1] if in_args else kwargs.get("grid_thw")
    if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
        return args, kwargs
    if grid.device == pixels.device:
        return args, kwargs
    moved = grid.to(pixels.device)
    if in_args:
        return (args[0], moved, *args[2:]), kwargs
    return args, {**kwargs, "grid_thw": moved}


@dataclass(eq=False)
class _CallParts:
    """What :meth:`Qwen2VLPlan.pack` reads from a call, and its host metadata on demand.

    The metadata (:class:`GridMetadata`: boundaries, positions, windows, position table rows) is
    computed the first time a graph needs it (:meth:`Qwen2VLPlan.load`), so a call served
    eagerly, which runs the tower's own forward, never pays for it: for Qwen3-VL's learned
    positions it is the larger part of the host work of a call.
    """

    pixels: torch.Tensor
    grid: torch.Tensor
    """``grid_thw`` on the host."""
    grids: tuple[tuple[int, int, int], ...]
    fixed: dict[str, Any]
    compute: Callable[[tuple[tuple[int, int, int], ...]], GridMetadata]

    @functools.cached_property
    def host(self) -> GridMetadata:
        """The call's metadata on the host, computed once."""
        return self.compute(self.grids)


class Qwen2VLPlan(PackedTowerPlan):
    """The tower's whole forward per token budget, with attention routed to a backend that
    reads the budget's boundaries."""

    dense = True
    casts_inputs = True  # the patch embedding casts the pixels to its weights' dtype
    v_in_qkv = True  # q, k and v from one product; q and k rotated into tensors of their own
    dense_in_auto = False

    def __init__(
        self,
        tower: nn.Module,
        adapter: Qwen2VLAdapter,
        context: PlanContext,
        kind: _TowerKind,
        *,
        choices: SpeedChoices,
    ) -> None:
        super().__init__(tower, adapter, context, kind)
        blocks = list(tower.blocks)
        embeddings = getattr(tower, "embeddings", None)
        self.patch_rewrites = [
            *choices.take(
                "patch_matmul", lambda on: packed_patch_matmul_for(tower.patch_embed, on), []
            ),
            *choices.take(
                "positions_matmul",
                lambda on: resampled_positions_for(embeddings, on),
                [],
            ),
        ]
        """The patch embedding as one matrix product with ``patch_matmul``, the position table
        resampled as one with ``positions_matmul``; empty without either."""
        self.norm_rewrites = choices.take(
            "fuse_norm", lambda on: fused_norms(blocks, on, kind.layer_form), []
        )
        """One fused add-and-norm rewrite per block with ``fuse_norm``; empty without."""
        mlps = [block.mlp for block in blocks]
        self.gelu_rewrites = choices.take(
            "fuse_gelu", lambda setting: gelu_epilogues(mlps, setting), []
        )
        """One :class:`GeluEpilogue` per block with ``fuse_gelu``; empty without."""
        aligned = choices.take("align_mlp", lambda on: [AlignedMLP(mlp) for mlp in mlps], [])
        gated = choices.take(
            "fuse_gate", lambda on: [AlignedMLP(mlp, fuse_activation=True) for mlp in mlps], []
        )
        self.alignments = gated or aligned
        """One :class:`AlignedMLP` per block with ``align_mlp`` or ``fuse_gate``; empty
        without."""
        attention_class = type(tower.blocks[0].attn)
        own_rotation = sys.modules[attention_class.__module__].apply_rotary_pos_emb_vision
        device = next(tower.parameters()).device
        self.rotation: Callable[..., tuple[torch.Tensor, torch.Tensor]] = choices.take(
            "fuse_rotary", lambda on: FusedRotary(own_rotation, device), own_rotation
        )
        """What the routed attention rotates q and k with: the family's
        ``apply_rotary_pos_emb_vision``, or with ``fuse_rotary`` its fused kernel."""
        self.windows = kind.windows
        self.learned_positions = kind.learned_positions
        self.grid_rows = kind.grid_rows
        self.qk_norms = kind.qk_norms
        self.separate_qkv = kind.separate_qkv
        self.budget_unit = tower.spatial_merge_size**2
        if adapter.budget_step % self.budget_unit or adapter.max_tokens % adapter.budget_step:
            raise ValueError(
                f"budget_step {adapter.budget_step} must be a multiple of the merge unit "
                f"({self.budget_unit} tokens) and max_tokens {adapter.max_tokens} a multiple of it"
            )
        if self.windows:
            self.window_side = max(
                tower.window_size // tower.spatial_merge_size // tower.patch_size, 1
            )
            """A window's side in merged tokens."""
            self.window_tokens = self.window_side**2 * self.budget_unit
            """The most tokens one window holds: the windowed layers' ``max_seqlen``."""
        self.staged_fields = self._declared_fields()
        self._grid_sizes: dict[tuple[tuple[int, int, int], ...], tuple[int, int]] = {}
        self._host_calls = GridMetadataCache(lambda grid: self._compute_host_call(grid))
        """The metadata of calls' grids, from each grid entry's, kept."""
        self.attention_by_budget: dict[int, str] = {}
        """Which backend serves each budget's full-attention layers and, for a tower with
        windows, its windowed layers (``attention="auto"`` times them apart)."""

    def _declared_fields(self) -> tuple[StagedField, ...]:
        """The metadata the tower's graphs read per call: positions and frame boundaries, and
        its windows' order and boundaries, its position table's rows and weights and its
        ``grid_thw`` rows where it has them."""
        fields = [StagedField.per_token("position_ids", torch.long), StagedField.boundaries()]
        if self.windows:
            fields += [
                StagedField(
                    "window_index", lambda b, s: b // self.budget_unit, torch.long, "count"
                ),
                StagedField(
                    "cu_window_seqlens",
                    lambda b, s: self.window_slots(b, s) + 1,
                    torch.int32,
                    "boundaries",
                ),
            ]
        if self.grid_rows:
            fields.append(StagedField("grid_thw", lambda b, s: s + 1, torch.long, "ones"))
        if self.learned_positions:
            fields += [StagedField.per_token(name) for name in ("interp_indices", "interp_weights")]
        return tuple(fields)

    @property
    def attention_routing(self) -> str:
        routing = super().attention_routing
        if isinstance(self.rotation, FusedRotary):
            return f"{routing}, q and k rotated by one kernel (fuse_rotary)"
        return routing

    # ---- what the runner asks ----------------------------------------------------------------

    def region(self, *args: Any, **kwargs: Any) -> Any:
        for alignment in self.alignments:
            alignment.refresh()
        buffers = self.current()
        if buffers is None:
            args, kwargs = _grid_beside_pixels(args, kwargs)
        else:
            self.prepare_attention(buffers)
        return self.own(*args, **kwargs)

    def prepare_attention(self, buffers: QwenBuffers) -> None:
        """Each attention backend's per-forward work (:meth:`AttentionBackend.prepare`: a dense
        backend's block mask), once before the layers, over the budget's tokens in the layers'
        dtype."""
        weight = next(self.attentions[0].parameters())
        tokens = weight.new_empty(buffers.pixels.shape[0], 0)
        buffers.backend.prepare(buffers.metadata, tokens)
        if buffers.window is not None:
            buffers.window.backend.prepare(buffers.window.metadata, tokens)

    def sequence_of(self, call: PackedCall) -> Hashable:
        return f"up to {call.signature[-1]} frames"

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for alignment in self.alignments:
            changes.apply(alignment)
            changes.apply(AlignedForward(alignment))
        for rewrite in (*self.patch_rewrites, *self.gelu_rewrites, *self.norm_rewrites):
            changes.apply(rewrite)

    # ---- packing -----------------------------------------------------------------------------

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        fixed = {name: value for name, value in kwargs.items() if name not in TEXT_ONLY_ARGUMENTS}
        pixels = fixed.pop("hidden_states", args[0] if args else None)
        grid = fixed.pop("grid_thw", args[1] if len(args) > 1 else None)
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise UnsupportedCall("the tower needs hidden_states and grid_thw as tensors")
        if len(args) > 2:
            raise UnsupportedCall("arguments past grid_thw were passed by position")
        frozen = _frozen_arguments(fixed) if fixed else ()
        if pixels.dim() != 2 or grid.dim() != 2 or grid.shape[1] != 3:
            raise UnsupportedCall(
                f"input hidden_states {tuple(pixels.shape)} and grid_thw {tuple(grid.shape)} "
                f"are not [patches, features] and [entries, 3]"
            )
        on_host = grid.cpu()
        grids = tuple(map(tuple, on_host.tolist()))
        tokens, slots = self._grid_sizes.get(grids) or self._sizes_of(grids)
        if tokens != pixels.shape[0]:
            raise UnsupportedCall(
                f"input hidden_states has {pixels.shape[0]} patches, grid_thw {tokens}"
            )
        signature = (pixels.dtype, pixels.shape[1], frozen, slots)
        return PackedCall(
            args=args,
            kwargs=kwargs,
            size=tokens,
            signature=signature,
            tensors=(pixels,),
            parts=_CallParts(pixels, on_host, grids, fixed, self._host_calls),
        )

    def _sizes_of(self, grids: tuple[tuple[int, int, int], ...]) -> tuple[int, int]:
        """The tokens and image slots of a call of ``grids``, kept for the grids that recur
        (up to 256 of them); :class:`~layergraph.keys.UnsupportedCall` for grids the tower
        cannot take."""
        self._check_grid(grids)
        if self.grid_rows and any(t > 1 for t, _, _ in grids):
            raise UnsupportedCall(
                "an entry of grid_thw holds several frames, and the tower's forward reads "
                "grid_thw's rows by frame (its VLM passes a video as one row per frame)"
            )
        sizes = sum(t * h * w for t, h, w in grids), image_slots(sum(t for t, _, _ in grids))
        if len(self._grid_sizes) < 256:
            self._grid_sizes[grids] = sizes
        return sizes

    def _check_grid(self, grids: tuple[tuple[int, int, int], ...]) -> None:
        """Raise :class:`~layergraph.keys.UnsupportedCall` for ``grid_thw`` rows the tower
        cannot take: none, or a side that is not a positive multiple of the merge size."""
        if not grids:
            raise UnsupportedCall("input grid_thw holds no image or video")
        merge = self.owner.spatial_merge_size
        for row in grids:
            t, h, w = row
            if t < 1 or h < merge or w < merge or h % merge or w % merge:
                raise UnsupportedCall(
                    f"input grid_thw row {list(row)}: t must be positive, h and w positive "
                    f"multiples of the spatial merge size {merge}"
                )

    def _compute_host_call(self, grid: torch.Tensor) -> GridMetadata:
        """The boundaries, positions and windows of ``grid_thw`` on the host (one entry: the
        calls' are joined from their entries'), by transformers' own functions."""
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
            get_vision_window_index,
        )

        tower = self.owner
        window_index = cu_window_seqlens = None
        if self.windows:
            window_index, cu_window_seqlens = get_vision_window_index(
                grid, tower.spatial_merge_size, tower.window_size, tower.patch_size
            )
        interp_indices = interp_weights = None
        if self.learned_positions:
            interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
                grid,
                num_grid_per_side=tower.num_grid_per_side,
                mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners,
                spatial_merge_size=tower.spatial_merge_size,
            )
        return GridMetadata(
            position_ids=get_vision_position_ids(grid, tower.spatial_merge_size),
            cu_seqlens=get_vision_cu_seqlens(grid),
            window_index=window_index,
            cu_window_seqlens=cu_window_seqlens,
            interp_indices=interp_indices,
            interp_weights=interp_weights,
        )

    def image_tokens(self, call: PackedCall) -> list[int]:
        return [t * h * w for t, h, w in call.parts.grids]

    def split(self, call: PackedCall, budget: int) -> list[PackedCall]:
        """Split by entries, a video above ``budget`` first cut into entries of as many frames
        as fit: attention never crosses a frame and positions repeat per frame, so the answer
        is the uncut video's."""
        grids = call.parts.grids
        if not any(t > 1 and t * h * w > budget >= h * w for t, h, w in grids):
            return super().split(call, budget)
        cut = []
        for t, h, w in grids:
            step = budget // (h * w) if t * h * w > budget >= h * w else t
            cut += [(min(step, t - start), h, w) for start in range(0, t, step)]
        grid = call.argument("grid_thw", position=1)
        frames = torch.tensor(cut, dtype=grid.dtype, device=grid.device)
        return super().split(self.pack((call.parts.pixels, frames), call.parts.fixed), budget)

    def piece(self, call: PackedCall, images: range) -> PackedCall:
        parts = call.parts
        starts = [0, *itertools.accumulate(self.image_tokens(call))]
        grid = call.argument("grid_thw", position=1)
        pixels = parts.pixels[starts[images.start] : starts[images.stop]]
        return self.pack((pixels, grid[images.start : images.stop]), parts.fixed)

    def allocate(self, budget: int, call: PackedCall[_CallParts]) -> QwenBuffers:
        parts = call.parts
        device, slots = parts.pixels.device, call.signature[-1]
        computing = self.computing(device)
        backend, full = self.choose_attention(
            budget, slots, budget, parts.host.cu_seqlens.diff().tolist(), computing
        )
        chosen = f"full: {backend.described}"
        window = None
        if self.windows:
            window_backend, window_metadata = self.choose_attention(
                budget,
                self.window_slots(budget, slots),
                min(self.window_tokens, budget),
                parts.host.cu_window_seqlens.diff().tolist(),
                computing,
            )
            window = _Windows(metadata=window_metadata, backend=window_backend)
            chosen += f", windows: {window.backend.described}"
        self.attention_by_budget[budget] = chosen
        backends = (backend,) if window is None else (backend, window.backend)
        staged = StagedMetadata.allocate(
            self.staged_fields, budget, slots, self.host_metadata(call), device
        )
        return QwenBuffers(
            budget=budget,
            pixels=torch.zeros(
                budget, parts.pixels.shape[1], dtype=parts.pixels.dtype, device=device
            ),
            grid_thw=(
                staged.device["grid_thw"]
                if self.grid_rows
                else torch.zeros(1, 3, dtype=torch.long, device=device)
            ),
            metadata=full,
            window=window,
            backend=backend,
            workspace=workspace(budget, self.heads, self.head_dim, computing, *backends),
            fixed=parts.fixed,
            staged=staged,
        )

    def window_slots(self, budget: int, frames: int) -> int:
        """The most windows a call of at most ``budget`` tokens in at most ``frames`` frames
        holds: the windowed layers' sequence count, which sizes the kernel's grid.

        A frame of ``m`` merged tokens (``h`` by ``w``) in windows of ``s`` by ``s`` has
        ``ceil(h / s) * ceil(w / s) <= m / s + (s - 1) / s`` windows (as ``h + w <= m + 1``),
        so a call of ``M`` merged tokens has fewer than ``M / s + frames``, and at most ``M``.
        """
        merged = budget // self.budget_unit
        return min(merged, -(-merged // self.window_side) + frames)

    def host_metadata(self, call: PackedCall[_CallParts]) -> dict[str, torch.Tensor]:
        host = call.parts.host
        values = {name: getattr(host, name) for name in _PRECOMPUTED if hasattr(host, name)}
        return {**values, "grid_thw": call.parts.grid}

    def load(self, buffers: QwenBuffers, call: PackedCall[_CallParts]) -> None:
        pixels, tokens = call.parts.pixels, call.size
        loaded = buffers.load_staged(call.parts.grids, lambda: self.host_metadata(call))
        if loaded and buffers.window is not None:
            copy_boundaries(buffers.window.metadata, buffers.staged.device["cu_window_seqlens"])
        buffers.pixels[:tokens].copy_(pixels)
        if buffers.filled > tokens:
            buffers.pixels[tokens : buffers.filled].zero_()
        buffers.filled = tokens

    def arguments(self, buffers: QwenBuffers) -> tuple[tuple[Any, ...], dict[str, Any]]:
        staged = buffers.staged.device
        kwargs = {
            **buffers.fixed,
            **{name: staged[name] for name in _STAGED_ARGUMENTS if name in staged},
            "grid_thw": buffers.grid_thw,
            "cu_seqlens": buffers.metadata.cu_seqlens,
            "max_seqlen": buffers.metadata.max_seqlen,
        }
        if buffers.window is not None:
            kwargs["cu_window_seqlens"] = buffers.window.metadata.cu_seqlens
            kwargs["max_window_seqlen"] = buffers.window.metadata.max_seqlen
        return (buffers.pixels,), kwargs

    def cut(self, output: Any, call: PackedCall, budget: int) -> Any:
        leaves, spec = pytree.tree_flatten(output)
        return pytree.tree_unflatten(self.cut_leaves(leaves, spec, call, budget)[0], spec)

    def cut_leaves(
        self, leaves: Sequence[Any], spec: pytree.TreeSpec, call: PackedCall, budget: int
    ) -> tuple[list[Any], pytree.TreeSpec]:
        """The call's rows of each tensor whose rows are the budget's tokens or merged tokens
        (views); the output's structure is unchanged."""
        rows = {budget: call.size, budget // self.budget_unit: call.size // self.budget_unit}
        return [
            leaf[: rows[leaf.shape[0]]]
            if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] in rows
            else leaf
            for leaf in leaves
        ], spec

    def attend_packed(
        self,
        module: nn.Module,
        buffers: QwenBuffers,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """A vision attention module over the packed tokens: q, k and v from its fused
        projection, q and k normalised (GLM-OCR's, GLM-5-Next's) and rotated by the module's
        own ``apply_rotary_pos_emb_vision`` (or its fused kernel, ``fuse_rotary``), handed to
        the full-attention backend, or to the windowed one where the tower passes the window
        boundaries: one operator to ``torch.compile`` either way (``opaque_attention``), which
        tells the two apart and reads the bound buffers when it runs, so that compiled layers
        serve every layer and budget with one version. The backends' per-forward work is done
        before the layers (:meth:`prepare_attention`)."""
        tokens = hidden_states.shape[0]
        if self.separate_qkv:
            q, k, v = (
                projection(hidden_states).view(tokens, module.num_heads, -1)
                for projection in (module.q, module.k, module.v)
            )
        else:
            q, k, v = module.qkv(hidden_states).view(tokens, 3, module.num_heads, -1).unbind(1)
        if self.qk_norms:
            q, k = module.q_norm(q), module.k_norm(k)
        q, k = self.rotation(q, k, *position_embeddings)
        out = opaque_attention(q, k, v, _ROUTE, module.scaling, cu_seqlens)
        return module.proj(out.reshape(tokens, -1))


class Qwen2VLAdapter(PackedTowerAdapter):
    """Graphs a Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 or GLM (GLM-4.1V, GLM-4.5V,
    GLM-4.6V, GLM-OCR, GLM-5-Next) vision tower, alone or inside its VLM, per token budget.

    ``attention``: ``sdpa_varlen``, ``triton``, ``fa3``, ``sdpa_dense_masked`` (a GPU: the
    budget's tokens under one block-diagonal mask per kind of attention, frames or windows, up
    to 4,096 tokens; served only where named), a registered backend that reads sequence
    boundaries at run time, or ``auto`` (the fastest of the others, timed per budget and kind
    of attention). ``max_tokens``: the largest budget learnt (larger calls are split by
    images); ``budget_step``: learnt budgets are multiples of it. The speed options
    ``align_mlp``, ``fuse_norm``, ``fuse_gelu``, ``fuse_rotary`` and ``fuse_gate`` (default
    ``"auto"``) and ``patch_matmul`` and ``positions_matmul`` (default off) are declared in
    :data:`~layergraph_adapters.kit.automatic.SPEED_OPTIONS` and tabled, with the towers each
    fits, in the speed-options tutorial; ``"auto"`` takes one where the tower is on a CUDA
    device and the option fits its layers.
    """

    name = "qwen2_vl"
    families = _TOWERS
    plan_class = Qwen2VLPlan
    speed_options = (
        "patch_matmul",
        "positions_matmul",
        "align_mlp",
        "fuse_norm",
        "fuse_gelu",
        "fuse_gate",
        "fuse_rotary",
    )

    def __init__(
        self,
        attention: str = "auto",
        max_tokens: int = 16384,
        budget_step: int = 16,
        align_mlp: bool | str = "auto",
        fuse_norm: bool | str = "auto",
        fuse_gelu: bool | str = "auto",
        fuse_rotary: bool | str = "auto",
        fuse_gate: bool | str = "auto",
        patch_matmul: bool | str = False,
        positions_matmul: bool | str = False,
    ) -> None:
        super().__init__(attention, max_tokens, budget_step)
        self.patch_matmul = patch_matmul
        self.positions_matmul = positions_matmul
        self.align_mlp = align_mlp
        self.fuse_norm = fuse_norm
        self.fuse_gelu = fuse_gelu
        self.fuse_rotary = fuse_rotary
        self.fuse_gate = fuse_gate


def _frozen_arguments(fixed: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A call's arguments besides the pixels and the grid, as part of its signature; raises
    :class:`~layergraph.keys.UnsupportedCall` for a precomputed argument, a tensor or a value
    that is not hashable."""
    given = sorted(set(fixed) & set(_PRECOMPUTED))
    if given:
        raise UnsupportedCall(f"precomputed {', '.join(given)} were given")
    if any(isinstance(value, torch.Tensor) for value in fixed.values()):
        raise UnsupportedCall("a tensor argument besides hidden_states and grid_thw")
    frozen = tuple(sorted(fixed.items()))
    try:
        hash(frozen)
    except TypeError:
        raise UnsupportedCall("an argument that is not hashable") from None
    return frozen


_ROUTE = "qwen"
"""The Qwen-VL and GLM towers' routed attention's name for ``opaque_attention``."""


def _attend_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, boundaries: torch.Tensor
) -> torch.Tensor:
    """q, k and v through the bound buffers' windowed backend and metadata where
    ``boundaries`` are their window boundaries (the same memory), else the full-attention
    ones (run at run time, opaque to ``torch.compile``)."""
    buffers = bound_buffers()
    window = getattr(buffers, "window", None)
    if window is not None and boundaries.data_ptr() == window.metadata.cu_seqlens.data_ptr():
        return PackedTowerPlan.attend(buffers, q, k, v, scale, window.metadata, window.backend)
    return PackedTowerPlan.attend(buffers, q, k, v, scale, buffers.metadata, buffers.backend)


register_route(_ROUTE, _attend_bound)


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(Qwen2VLAdapter)
