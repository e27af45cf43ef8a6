"""Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's and GLM-4.1V's vision towers for benchmarks:
configurations, inputs, and the hand-written graph layergraph is measured against.

The hand-written graph is what a user writes without layergraph: the tower's forward given its
precomputed boundaries, positions and windows for one exact grid (transformers'
``vision_utils``, as the towers compute them), attention through a varlen kernel, captured with
``torch.cuda.graph``. Used by ``benchmarks/packed_towers.py``; nothing here serves calls.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.specifiers import SpecifierSet
from torch import nn
from transformers import vision_utils

from layergraph_adapters.example_models.packed import PACKED_EXAMPLES
from layergraph_adapters.kit.versions import UNCHECKED_VARIABLE
from layergraph_adapters.qwen2_vl import GLM_SUPPORT, QWEN3_5_SUPPORT, QWEN_SUPPORT

ADAPTER = "qwen2_vl"
"""The layergraph adapter that serves these towers."""


@dataclass(frozen=True)
class Tower:
    """A tower to benchmark: its class and configuration, and the module beside this one
    whose functions make its inputs and calls (``qwen_towers``, ``pixtral_towers``)."""

    name: str
    module: str
    cls: str
    config: Callable[[], Any]
    kit: str = "qwen_towers"
    video_rows: bool = False
    """Whether the tower is given a video as one ``grid_thw`` row per frame (GLM-4.1V's, whose
    forward reads the rows by frame; its VLM passes videos so)."""
    served_with: str = QWEN_SUPPORT.checked
    """The transformers releases the tower's adapter serves it with."""

    def served_here(self) -> bool:
        """Whether the installed transformers is one of :attr:`served_with` (or the adapters'
        release check is switched off), so that wrapping the tower does not refuse it."""
        if os.environ.get(UNCHECKED_VARIABLE) == "1":
            return True
        return SpecifierSet(self.served_with).contains(transformers.__version__, prereleases=True)


def towers(tiny: bool) -> list[Tower]:
    """Qwen2.5-VL-7B's, Qwen3-VL-8B's, Qwen3.5's and GLM-4.1V-9B's vision towers, or four-layer
    ones like them. Qwen3.5's is its configuration's defaults (27 layers of 1152, 16 heads,
    patch 16, merge 2, a 48x48 position table, 3584 out: Qwen3-VL-8B's without the deep-stack
    mergers); GLM-4.1V-9B's too (24 layers of 1536, 12 heads, patch 14, merge 2, 4096 out, a
    24x24 position table). The full-size ones are the ``qwen2_vl`` adapter's example towers
    (``layergraph bench --list-models``, ``layergraph_adapters.example_models``)."""
    qwen25 = dict(PACKED_EXAMPLES["qwen2.5-vl-7b"].example.settings)
    qwen3 = dict(PACKED_EXAMPLES["qwen3-vl-8b"].example.settings)
    qwen35: dict[str, Any] = {}
    glm4v: dict[str, Any] = {}
    if tiny:
        small = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32)
        qwen25.update(small, window_size=56, fullatt_block_indexes=[1, 3])
        qwen3.update(small, num_position_embeddings=16, deepstack_visual_indexes=[1, 2])
        qwen35.update(small, num_position_embeddings=16)
        glm4v.update(small, image_size=56)
    return [
        Tower(
            "qwen2.5-vl-7b" if not tiny else "qwen2.5-vl-tiny",
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VisionTransformerPretrainedModel",
            lambda: transformers.Qwen2_5_VLVisionConfig(**qwen25),
        ),
        Tower(
            "qwen3-vl-8b" if not tiny else "qwen3-vl-tiny",
            "transformers.models.qwen3_vl.modeling_qwen3_vl",
            "Qwen3VLVisionModel",
            lambda: transformers.Qwen3VLVisionConfig(**qwen3),
        ),
        Tower(
            "qwen3.5" if not tiny else "qwen3.5-tiny",
            "transformers.models.qwen3_5.modeling_qwen3_5",
            "Qwen3_5VisionModel",
            lambda: transformers.Qwen3_5VisionConfig(**qwen35),
            served_with=QWEN3_5_SUPPORT.checked,
        ),
        Tower(
            "glm-4.1v-9b" if not tiny else "glm-4.1v-tiny",
            "transformers.models.glm4v.modeling_glm4v",
            "Glm4vVisionModel",
            lambda: transformers.Glm4vVisionConfig(**glm4v),
            video_rows=True,
            served_with=GLM_SUPPORT.checked,
        ),
    ]


def build(tower: Tower, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The tower with random weights, in eval mode."""
    cls = getattr(importlib.import_module(tower.module), tower.cls)
    torch.manual_seed(0)
    with torch.device(device):
        return cls(tower.config()).to(dtype).eval()


def grid_for(config: Any, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of an image or video for a tower of ``config``, its sides
    rounded to the nearest multiple of patch times merge size (at least one), as the towers'
    processors resize them."""
    patch, merge = config.patch_size, config.spatial_merge_size
    factor = patch * merge
    side = [max(factor, round(length / factor) * factor) // patch for length in (height, width)]
    return (frames, side[0], side[1])


def pixels_for(
    model: nn.Module, grids: list[tuple[int, int, int]], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random patches for ``grids`` in the tower's dtype and device, and ``grid_thw``."""
    config = model.config
    features = config.in_channels * config.temporal_patch_size * config.patch_size**2
    tokens = sum(t * h * w for t, h, w in grids)
    parameter = next(model.parameters())
    pixels = torch.randn(tokens, features, generator=generator).to(parameter)
    return pixels, torch.tensor(grids, device=parameter.device)


def call(model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> Any:
    """One call of the tower (or its wrapper), as a VLM makes it."""
    return model(pixels, grid_thw=grid)


def features(output: Any) -> torch.Tensor:
    """What a VLM reads: the merged features."""
    return output.pooler_output


def stream_requests(
    config: Any, count: int, sizes: tuple[tuple[int, int], ...], seed: int
) -> list[list[tuple[int, int, int]]]:
    """``count`` requests of 1 to 3 entries for a tower of ``config``: images of ``sizes``, one
    entry in eight a video of 2 or 4 temporal patches at one of the two smallest sizes."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        entries = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 1 / 8:
                width, height = rng.choice(sizes[:2])
                entries.append(grid_for(config, width, height, frames=rng.choice((2, 4))))
            else:
                entries.append(grid_for(config, *rng.choice(sizes)))
        requests.append(entries)
    return requests


def frame_rows(grids: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``grids`` with every video as one row per frame, as a tower of
    :attr:`Tower.video_rows` is given them."""
    return [(1, h, w) for t, h, w in grids for _ in range(t)]


def precomputed(model: nn.Module, grid: torch.Tensor) -> dict[str, Any]:
    """The tower's precomputed arguments for exactly ``grid``, by transformers' own functions,
    on the tower's device: what a user capturing it by hand passes so that no host work runs."""
    device, merge = grid.device, model.spatial_merge_size
    host = grid.cpu()
    cu_seqlens = vision_utils.get_vision_cu_seqlens(host)
    kwargs: dict[str, Any] = {
        "position_ids": vision_utils.get_vision_position_ids(host, merge),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(cu_seqlens.diff().max()),
    }
    if hasattr(model, "window_size"):
        index, cu_windows = vision_utils.get_vision_window_index(
            host, merge, model.window_size, model.patch_size
        )
        kwargs.update(
            window_index=index,
            cu_window_seqlens=cu_windows,
            max_window_seqlen=int(cu_windows.diff().max()),
        )
    if hasattr(model, "num_grid_per_side"):
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            host,
            num_grid_per_side=model.num_grid_per_side,
            mode=model.interpolation_mode,
            align_corners=model.interpolation_align_corners,
            spatial_merge_size=merge,
        )
        kwargs.update(interp_indices=indices, interp_weights=weights)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Each packed sequence attending to itself: layergraph's Triton varlen kernel on a GPU,
    a loop of SDPA calls over the sequences elsewhere."""
    if q.is_cuda:
        from layergraph.attention.triton_varlen import varlen_attention

        out = torch.empty_like(q)
        return varlen_attention(q, k, v, out, cu_seqlens, seq_lens, max_seqlen, scale)
    parts = [
        F.scaled_dot_product_attention(
            *(t[start:stop].transpose(0, 1) for t in (q, k, v)), scale=scale
        ).transpose(0, 1)
        for start, stop in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    ]
    return torch.cat(parts)


@contextlib.contextmanager
def varlen_attention_forwards(
    model: nn.Module, seq_lens: dict[int, torch.Tensor]
) -> Iterator[None]:
    """The tower's attention modules computing through :func:`attend`; ``seq_lens`` gives the
    lengths of each boundaries tensor the tower passes (by its ``id``)."""
    blocks = list(model.blocks)
    rotate = sys.modules[type(blocks[0].attn).__module__].apply_rotary_pos_emb_vision
    for block in blocks:
        attention = block.attn

        def forward(
            hidden_states: torch.Tensor,
            cu_seqlens: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            max_seqlen: int,
            attention: nn.Module = attention,
            **kwargs: Any,
        ) -> torch.Tensor:
            tokens = hidden_states.shape[0]
            qkv = attention.qkv(hidden_states).view(tokens, 3, attention.num_heads, -1)
            q, k, v = qkv.unbind(1)
            q, k = rotate(q, k, *position_embeddings)
            lengths = seq_lens[id(cu_seqlens)]
            out = attend(q, k, v, cu_seqlens, lengths, max_seqlen, attention.scaling)
            return attention.proj(out.reshape(tokens, -1))

        attention.forward = forward
    try:
        yield
    finally:
        for block in blocks:
            del block.attn.forward


class HandGraph:
    """One exact shape captured by hand: the tower's forward with its precomputed arguments
    and varlen attention, inside ``torch.cuda.graph`` (on a CPU it runs eagerly). Calls copy
    new patches into the static input and return the graph's static output."""

    def __init__(self, model: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        self.model, self.static, self.grid = model, pixels.clone(), grid
        self.kwargs = precomputed(model, grid)
        self.seq_lens = {
            id(self.kwargs[name]): self.kwargs[name].diff()
            for name in ("cu_seqlens", "cu_window_seqlens")
            if name in self.kwargs
        }
        self.graph = None
        if pixels.is_cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), varlen_attention_forwards(model, self.seq_lens):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), varlen_attention_forwards(model, self.seq_lens):
                self.output = self._forward()

    def _forward(self) -> Any:
        return self.model(self.static, grid_thw=self.grid, **dict(self.kwargs))

    def __call__(self, pixels: torch.Tensor) -> Any:
        self.static.copy_(pixels)
        if self.graph is None:
            with varlen_attention_forwards(self.model, self.seq_lens):
                return self._forward()
        self.graph.replay()
        return self.output
