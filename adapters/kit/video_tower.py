"""The plan of video towers of fixed clips: frames of one size and count in, one sequence of
space-time tokens out.

VideoMAE, ViViT and TimeSformer take ``pixel_values`` of shape
``[clips, frames, channels, height, width]`` at their configuration's frame count and image
size (their position tables are made for them), cut into tubelets or per-frame patches, then
layers over one sequence. Every call of a model has the same sequence, so its graphs are keyed
by the number of clips alone, padded to a captured count as images are.

What this does not do: take another frame count or image size (the towers' position tables do
not interpolate; the plan refuses them with the sizes the tower takes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from layergraph.keys import CallInputs
from layergraph.ledger import ChangeLedger
from layergraph_adapters.kit.device_tensors import tensor_attributes
from layergraph_adapters.kit.hf_vision import VisionTowerPlan
from layergraph_adapters.kit.tower_specs import pair

__all__ = ["VideoClips", "VideoTowerPlan", "video_clips"]


class VideoClips(NamedTuple):
    """The sequence of a video tower's key: tokens per clip, frames, and the frame size."""

    tokens: int
    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens ({self.frames} frames of {self.height}x{self.width})"


def video_clips(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """``pixel_values``: ``batch`` random clips of the configuration's frame count and size."""
    height, width = pair(config.image_size)
    shape = (batch, config.num_frames, config.num_channels, height, width)
    return {"pixel_values": torch.randn(*shape, dtype=dtype, device=device)}


class VideoTowerPlan(VisionTowerPlan):
    """A video tower's whole forward, keyed by (clips, tokens per clip); a position table kept
    as a plain tensor attribute (VideoMAE's) is a buffer on the device while wrapped
    (:func:`~layergraph_adapters.kit.device_tensors.tensor_attributes`)."""

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for change in tensor_attributes(self.owner):
            changes.apply(change)

    def read_geometry(self, config: Any) -> None:
        self.prefix_tokens = self.spec.prefix_for(config)
        self.image_sizes = "fixed"
        self.image_size = pair(config.image_size)
        self.channels = config.num_channels
        self.frames: int = config.num_frames
        tubelet = getattr(config, "tubelet_size", 1)
        if isinstance(tubelet, (list, tuple)):  # ViViT's: (frames, height, width)
            self.frames_per_token, self.patch_size = int(tubelet[0]), pair(tubelet[1:])
        else:
            self.frames_per_token, self.patch_size = int(tubelet), pair(config.patch_size)

    def sequence_of(self, call: CallInputs) -> Hashable:
        height, width = self.image_size
        patches = (height // self.patch_size[0]) * (width // self.patch_size[1])
        tokens = (self.frames // self.frames_per_token) * patches + self.prefix_tokens
        return VideoClips(tokens, self.frames, height, width)

    def check_inputs(self, call: CallInputs) -> None:
        clips = call.argument("pixel_values", 0)
        name = type(self.owner).__name__
        if not isinstance(clips, torch.Tensor) or clips.dim() != 5:
            shape = tuple(clips.shape) if isinstance(clips, torch.Tensor) else type(clips)
            raise ValueError(
                f"{name} takes pixel_values of shape [clips, frames, channels, height, width], "
                f"got {shape}"
            )
        if not clips.is_floating_point():
            raise ValueError(f"pixel_values are {clips.dtype}: {name} takes floating-point frames")
        _, frames, channels, height, width = clips.shape
        want = (self.frames, self.channels, *self.image_size)
        if (frames, channels, height, width) != want:
            raise ValueError(
                f"{name} takes clips of {want[0]} frames of {want[1]} channels at "
                f"{want[2]}x{want[3]}, got {frames} frames of {channels} at {height}x{width}"
            )
