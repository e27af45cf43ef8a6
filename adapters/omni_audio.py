"""Plugin for the audio towers of Qwen2.5-Omni's and Qwen3-Omni's thinkers, per token budget.

``Qwen2_5OmniAudioEncoder`` and ``Qwen3OmniMoeAudioEncoder`` take the log-mel frames of every
clip of a call in one tensor (``input_features``, ``[mel bins, frames]``) with each clip's
frames (``feature_lens``). They cut each clip into chunks of ``2 * n_window`` frames (the last
shorter), run convolutions over the chunks padded to the longest, keep each chunk's real
tokens in one sequence, and attend within each chunk (Qwen2.5-Omni) or within windows of
chunks (Qwen3-Omni's ``n_window_infer``); Qwen2.5-Omni's then averages each clip's tokens in
pairs. This plugin serves them as the Qwen vision towers are served: graphs per token budget
(:mod:`layergraph.packing`), a call's chunks in a budget's chunk slots, its boundaries, token
indices and pooling indices staged per call, attention through a backend that reads the
boundaries at run time. A call larger than the largest budget is split between clips; a clip
that alone fills more than the largest budget runs eagerly.

Eager calls run the tower's own forward. A graph pads every chunk to ``2 * n_window`` frames;
where the tower's own forward pads to a call's longest chunk instead (a call of clips all
shorter than one chunk), the graph zeroes its convolutions' outputs past that length, as the
tower's own padding does, so the answer is the tower's.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layergraph import AdapterMismatch, hookimpl
from layergraph.keys import UnsupportedCall
from layergraph.packing import PackedCall
from layergraph_adapters.kit.budget_buffers import BudgetBuffers, StagedField
from layergraph_adapters.kit.family_record import Support
from layergraph_adapters.kit.packed_tower import (
    PackedFamily,
    PackedTowerAdapter,
    PackedTowerPlan,
    host_boundaries,
    image_slots,
    read_inputs,
)
from layergraph_adapters.kit.tower_specs import TEXT_ONLY_ARGUMENTS

__all__ = ["OMNI_AUDIO_FAMILIES", "OmniAudioAdapter", "OmniAudioPlan"]

_QWEN2_5 = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"
_QWEN3 = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"
_PATHS = ("audio_tower", "model.audio_tower", "thinker.audio_tower", "thinker.model.audio_tower")
"""Where a thinker (``audio_tower``, ``model.audio_tower`` from transformers 5.24) and a whole
Omni model (``thinker...``) hold the tower."""

OMNI_AUDIO_SUPPORT = Support(
    "qwen omni audio",
    ">=5.17.0,<5.25",
    ("layergraph_adapters.omni_audio:OmniAudioPlan.packed_forward",),
    ("the output's fields, from one call of the tower's own forward on one short clip",),
    ("tests/test_omni_audio.py",),
)
"""5.17.0 to 5.24.x: the towers' forwards compute chunks, token indices, boundaries and
pooling indices with the modeling modules' functions the plan calls; 5.24 adds
``pooler_output`` to the output, which the plan reads from the tower."""


@dataclass(frozen=True)
class AudioTowerKind(PackedFamily):
    """An Omni audio tower class and how its front and head compute."""

    pooled: bool = False
    """Whether the tower averages each clip's tokens in pairs before its last norm
    (Qwen2.5-Omni, with two 1-d convolutions in front; Qwen3-Omni has three 2-d ones)."""


OMNI_AUDIO_FAMILIES = (
    AudioTowerKind(
        module=_QWEN2_5,
        name="Qwen2_5OmniAudioEncoder",
        holders={_QWEN2_5: _PATHS},
        layers="layers",
        attention="self_attn",
        support=OMNI_AUDIO_SUPPORT,
        pooled=True,
    ),
    AudioTowerKind(
        module=_QWEN3,
        name="Qwen3OmniMoeAudioEncoder",
        holders={_QWEN3: _PATHS},
        layers="layers",
        attention="self_attn",
        support=OMNI_AUDIO_SUPPORT,
    ),
)
"""The served towers, and the thinkers and Omni models checked with them."""


@dataclass(eq=False)
class AudioBuffers(BudgetBuffers):
    """One budget's buffers: :attr:`pixels` holds the call's chunks (``[slots, mel bins,
    2 * n_window]``, zeros past each chunk and in the slots past the call's); the chunks'
    frames, the call's longest chunk, each token's place in the chunks' grid, the pooled
    pairs and the boundaries are staged (:attr:`OmniAudioPlan.staged_fields`)."""


@dataclass(eq=False)
class _Clips:
    """What :meth:`OmniAudioPlan.pack` reads from a call, on the host."""

    features: torch.Tensor
    """``[mel bins, frames]``: the call's clips' frames, one after another."""
    frames: list[int]
    """Each clip's frames."""
    chunks: list[list[int]]
    """Each clip's chunks' frames."""
    tokens: list[list[int]]
    """Each clip's chunks' tokens."""
    sequences: list[list[int]]
    """Each clip's attention sequences' tokens (its chunks, or its windows of chunks)."""
    width: int
    """The frames of the longest chunk of the whole call (before any split): what the tower's
    own forward pads every chunk to."""
    slots: int
    options: dict[str, Any]

    @property
    def counts(self) -> list[int]:
        """The tokens of each attention sequence, in order."""
        return [length for clip in self.sequences for length in clip]

    @property
    def clip_tokens(self) -> list[int]:
        return [sum(clip) for clip in self.tokens]


class OmniAudioPlan(PackedTowerPlan):
    """An Omni audio tower per token budget (see the module's text)."""

    inputs = ("input_features", "feature_lens", "aftercnn_lens")
    options = frozenset({"output_attentions", "output_hidden_states", "return_dict"})
    staged_fields = (
        StagedField("chunk_frames", lambda budget, slots: slots, torch.int64),
        StagedField("width", lambda budget, slots: 1, torch.int64),
        StagedField.per_token("token_rows", torch.int64),
        StagedField("pairs", lambda budget, slots: budget // 2, torch.int64),
        StagedField.boundaries(),
    )

    def __init__(self, tower: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(tower, *args, **kwargs)
        self.modeling = sys.modules[type(tower).__module__]
        self.pooled = self.family.pooled
        self.window = 2 * tower.n_window
        """The frames of a whole chunk."""
        self.mel_bins = tower.num_mel_bins
        self.grid = self._conv_widths(self.window)[-1]
        """The tokens the convolutions make of a whole chunk: a row of the tokens' grid."""
        self._output_fields: tuple[str, ...] | None = None
        made = int(self._chunk_tokens(torch.tensor([self.window]))[0])
        if made != self.grid:
            raise AdapterMismatch(
                f"{type(tower).__name__} counts {made} tokens for a chunk of {self.window} "
                f"frames where its convolutions make {self.grid} (n_window "
                f"{tower.n_window}): its own forward cannot serve such a chunk either"
            )

    def _conv_widths(self, frames: int) -> list[int]:
        """The width after each stride-2 convolution of a chunk of ``frames``."""
        widths = [frames]
        for _ in range(1 if self.pooled else 3):
            widths.append((widths[-1] - 1) // 2 + 1)
        return widths[1:]

    # ---- the graph ---------------------------------------------------------------------------

    def packed_forward(self, buffers: AudioBuffers) -> torch.Tensor:
        """The tower over one budget's chunks: ``[budget // 2, output]`` pooled tokens
        (Qwen2.5-Omni) or ``[budget, output]`` tokens (Qwen3-Omni)."""
        tower, staged = self.owner, buffers.staged.device
        positions = torch.arange(self.window, device=buffers.pixels.device)
        if self.pooled:
            real = (positions < staged["chunk_frames"][:, None])[:, None]
            chunks = buffers.pixels.to(tower.conv1.weight.dtype)
            hidden = F.gelu(tower.conv1(chunks)) * real
            hidden = F.gelu(tower.conv2(hidden)).transpose(1, 2)
        else:
            hidden = buffers.pixels[:, None].to(tower.conv2d1.weight.dtype)
            width = staged["width"]
            for conv in (tower.conv2d1, tower.conv2d2):
                width = (width - 1) // 2 + 1
                hidden = F.gelu(conv(hidden))
                hidden = hidden * (positions[: hidden.shape[-1]] < width)
            hidden = F.gelu(tower.conv2d3(hidden))
            slots, channels, bins, tokens = hidden.shape
            hidden = hidden.permute(0, 3, 1, 2).reshape(slots, tokens, channels * bins)
            hidden = tower.conv_out(hidden)
        table = tower.positional_embedding.positional_embedding[: hidden.shape[1]]
        hidden = hidden + table.to(hidden.dtype)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, staged["token_rows"])
        for layer in self._layers:
            hidden = layer(hidden, None)[0]
        if self.pooled:
            pairs = staged["pairs"]
            hidden = (hidden[pairs] + hidden[pairs + 1]) / 2
            return tower.proj(tower.ln_post(hidden))
        return tower.proj2(tower.act(tower.proj1(tower.ln_post(hidden))))

    def attend_packed(
        self,
        module: nn.Module,
        buffers: AudioBuffers,
        hidden_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The audio attention over the packed tokens: q, k and v projected, the backend
        reading the sequences' boundaries, the output projected."""
        tokens = hidden_states.shape[0]
        q, k, v = (
            projection(hidden_states).view(tokens, module.num_heads, module.head_dim)
            for projection in (module.q_proj, module.k_proj, module.v_proj)
        )
        out = self.attend(buffers, q, k, v, module.scaling)
        return module.out_proj(out.reshape(tokens, -1))

    # ---- packing -----------------------------------------------------------------------------

    def sequence_of(self, call: PackedCall) -> Any:
        return f"up to {call.parts.slots} chunks"

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        given, options = read_inputs(
            args, kwargs, self.inputs, self.options, ignored=TEXT_ONLY_ARGUMENTS
        )
        features, lens = given.get("input_features"), given.get("feature_lens")
        if not isinstance(features, torch.Tensor) or not isinstance(lens, torch.Tensor):
            raise UnsupportedCall("the graphs need input_features and feature_lens as tensors")
        if features.dim() != 2 or features.shape[0] != self.mel_bins:
            raise ValueError(
                f"expected input_features of shape [{self.mel_bins} mel bins, frames] (every "
                f"clip's frames one after another), got {tuple(features.shape)}"
            )
        frames = [int(n) for n in lens.reshape(-1).tolist()]
        if not frames or min(frames) < 1 or sum(frames) != features.shape[1]:
            raise ValueError(
                f"feature_lens {frames} must give each clip's frames (at least one), summing "
                f"to the {features.shape[1]} frames of input_features"
            )
        return self._call(args, kwargs, features, frames, None, options)

    def _call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        features: torch.Tensor,
        frames: list[int],
        width: int | None,
        options: dict[str, Any],
    ) -> PackedCall:
        chunks = [self._chunks(n) for n in frames]
        flat = torch.tensor([c for clip in chunks for c in clip])
        width = max(flat.tolist()) if width is None else width
        tokens = self._chunk_tokens(flat).tolist()
        per_clip = _regroup(tokens, [len(clip) for clip in chunks])
        sequences = self._sequences(flat, frames, width)
        clips = _Clips(
            features,
            frames,
            chunks,
            per_clip,
            _per_clip(sequences, [sum(clip) for clip in per_clip]),
            width,
            image_slots(len(flat)),
            options,
        )
        return PackedCall(
            args=args,
            kwargs=kwargs,
            size=sum(tokens),
            signature=(features.dtype, clips.slots),
            tensors=(features,),
            parts=clips,
        )

    def _chunks(self, frames: int) -> list[int]:
        """A clip's chunks' frames: whole chunks, then the rest (as the tower cuts them)."""
        whole, rest = divmod(frames, self.window)
        return [self.window] * whole + ([rest] if rest else [])

    def _chunk_tokens(self, chunks: torch.Tensor) -> torch.Tensor:
        """The tokens each chunk makes, by the modeling module's own length function."""
        if self.pooled:
            return self.owner._get_feat_extract_output_lengths(chunks)[0]
        return self.modeling._get_feat_extract_output_lengths(chunks, self.owner.n_window)

    def _sequences(self, chunks: torch.Tensor, frames: list[int], width: int) -> list[int]:
        """The attention sequences' tokens, by the modeling module's boundaries. Qwen3-Omni's
        windows follow the call's longest chunk, ``width`` frames, which a piece of a split
        call may not hold: a chunk of ``width`` is put before the chunks the function reads
        their longest from (their count is read from ``frames``)."""
        if self.pooled:
            boundaries = self.modeling.get_audio_cu_seqlens(chunks)
        else:
            boundaries = self.modeling.get_audio_cu_seqlens(
                torch.cat([torch.tensor([width]), chunks]),
                torch.tensor(frames),
                self.owner.n_window_infer,
                self.owner.n_window,
            )
        return boundaries.diff().tolist()

    def image_tokens(self, call: PackedCall) -> Sequence[int]:
        return call.parts.clip_tokens

    def piece(self, call: PackedCall, images: range) -> PackedCall:
        clips: _Clips = call.parts
        start = sum(clips.frames[: images.start])
        frames = clips.frames[images.start : images.stop]
        features = clips.features[:, start : start + sum(frames)]
        lens = torch.tensor(frames)
        kwargs = {**clips.options, "input_features": features, "feature_lens": lens}
        return self._call((), kwargs, features, frames, clips.width, clips.options)

    def allocate(self, budget: int, call: PackedCall[_Clips]) -> AudioBuffers:
        clips = call.parts
        chunks = torch.zeros(
            clips.slots,
            self.mel_bins,
            self.window,
            dtype=clips.features.dtype,
            device=clips.features.device,
        )
        return self.new_buffers(AudioBuffers, budget, call, 0, chunks.dtype, pixels=chunks)

    def host_metadata(self, call: PackedCall[_Clips]) -> dict[str, torch.Tensor]:
        clips = call.parts
        tokens = [t for clip in clips.tokens for t in clip]
        rows = torch.cat([torch.arange(t) + i * self.grid for i, t in enumerate(tokens)])
        pairs = self.modeling.get_pool_indices(torch.tensor(clips.frames)) if self.pooled else None
        return {
            "chunk_frames": torch.tensor([c for clip in clips.chunks for c in clip]),
            "width": torch.tensor([clips.width]),
            "token_rows": rows,
            "pairs": pairs if pairs is not None else torch.zeros(0, dtype=torch.int64),
            "cu_seqlens": host_boundaries(clips.counts, clips.slots),
        }

    def load(self, buffers: AudioBuffers, call: PackedCall[_Clips]) -> None:
        clips = call.parts
        buffers.load_staged((tuple(clips.frames), clips.width), lambda: self.host_metadata(call))
        chunks, start, slot = buffers.pixels, 0, 0
        chunks.zero_()
        for clip in clips.chunks:  # a clip's whole chunks in one copy, then its rest
            whole = sum(frames == self.window for frames in clip)
            frames = clips.features[:, start : start + whole * self.window]
            chunks[slot : slot + whole].copy_(
                frames.view(self.mel_bins, whole, self.window).transpose(0, 1)
            )
            start, slot = start + whole * self.window, slot + whole
            if whole < len(clip):
                rest = clip[-1]
                chunks[slot, :, :rest] = clips.features[:, start : start + rest]
                start, slot = start + rest, slot + 1

    def cut(self, output: torch.Tensor, call: PackedCall[_Clips], budget: int) -> Any:
        clips = call.parts
        rows = sum(self._pooled_tokens(clips.frames)) if self.pooled else call.size
        hidden = output[:rows]
        if self._output_fields is None:
            self._output_fields = self._probe_output_fields(clips.features)
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        result = BaseModelOutputWithPooling(**dict.fromkeys(self._output_fields, hidden))
        return result if clips.options.get("return_dict", True) else result.to_tuple()

    def _pooled_tokens(self, frames: list[int]) -> list[int]:
        return self.owner._get_feat_extract_output_lengths(torch.tensor(frames))[1].tolist()

    def _probe_output_fields(self, like: torch.Tensor) -> tuple[str, ...]:
        """The fields the tower's own output sets (``pooler_output`` too from transformers
        5.24), from one call of its forward on one short clip."""
        frames = min(self.window, 8)
        features = torch.zeros(self.mel_bins, frames, dtype=like.dtype, device=like.device)
        with torch.no_grad():
            out = self.own(features, feature_lens=torch.tensor([frames], device=like.device))
        return tuple(name for name, value in out.items() if value is not None)


def _regroup(flat: Sequence[int], sizes: Any) -> list[list[int]]:
    """``flat`` cut, in order, into lists of ``sizes``."""
    items = iter(flat)
    return [list(itertools.islice(items, size)) for size in sizes]


def _per_clip(sequences: Sequence[int], clips: Sequence[int]) -> list[list[int]]:
    """``sequences`` (tokens each, in order) grouped by the clips of ``clips`` tokens each: a
    sequence never crosses a clip."""
    grouped, items = [], iter(sequences)
    for total in clips:
        clip: list[int] = []
        while sum(clip) < total:
            clip.append(next(items))
        grouped.append(clip)
    return grouped


class OmniAudioAdapter(PackedTowerAdapter):
    """The audio towers of Qwen2.5-Omni's and Qwen3-Omni's thinkers, alone or inside the
    thinker or the Omni model, per token budget (see the module's text)."""

    name = "omni_audio"
    families = OMNI_AUDIO_FAMILIES
    plan_class = OmniAudioPlan


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(OmniAudioAdapter)
