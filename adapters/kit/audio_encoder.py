"""The plan of Whisper-style audio encoders: log-mel features of one fixed length in, a
sequence of audio tokens out.

Whisper's encoder, distil-whisper's and Qwen2-Audio's take ``input_features`` of shape
``[clips, mel bins, frames]``, where ``frames`` is the one length their position table holds
(3000 for 30 s of audio): two 1-d convolutions (the second of stride 2) make
``max_source_positions`` tokens, then come the layers and a final norm (Qwen2-Audio pools the
tokens by two before it). Every call of a model has the same sequence, so its graphs are keyed
by the number of clips alone, and the measured policy pads a call's clips to a captured count
as it pads images. Inside a larger model (``WhisperForConditionalGeneration``, whose
``generate`` and transformers' ASR pipeline call the encoder once per batch of clips, or a
Qwen2-Audio VLM) the encoder's forward is routed to the graphs in place, and the rest of the
model (the decoder) runs eagerly.

What this does not do: take features of another length (the encoder refuses them, so the plan
does too, with the length it takes), or pack clips of different lengths (the Omni audio
towers' chunks; see the packed kit).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from layergraph.keys import CallInputs
from layergraph_adapters.kit.hf_vision import VisionTowerPlan

__all__ = ["AudioEncoderPlan", "AudioFrames", "mel_features"]


class AudioFrames(NamedTuple):
    """The sequence of an audio encoder's key: tokens per clip, and the mel frames that give
    them."""

    tokens: int
    frames: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens ({self.frames} mel frames)"


def mel_features(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """``input_features``: ``batch`` clips of random log-mel features of the length the
    encoder of ``config`` takes (``size`` is not read: an audio encoder takes one length)."""
    frames = 2 * config.max_source_positions
    features = torch.randn(batch, config.num_mel_bins, frames, dtype=dtype, device=device)
    return {"input_features": features}


class AudioEncoderPlan(VisionTowerPlan):
    """A Whisper-style audio encoder's whole forward, keyed by (clips, tokens per clip)."""

    def read_geometry(self, config: Any) -> None:
        tower = self.owner
        strides = tower.conv1.stride[0] * tower.conv2.stride[0]
        self.mel_bins: int = config.num_mel_bins
        self.frames: int = config.max_source_positions * strides
        """The length of the features the encoder takes."""
        self.tokens: int = self.frames // strides
        """The tokens a clip makes before any pooling."""

    def sequence_of(self, call: CallInputs) -> Hashable:
        return AudioFrames(self.tokens, self.frames)

    def check_inputs(self, call: CallInputs) -> None:
        features = call.argument("input_features", 0)
        name = type(self.owner).__name__
        if not isinstance(features, torch.Tensor):
            raise ValueError(
                f"{name} takes input_features, a tensor; got {type(features).__name__}"
            )
        if features.dim() != 3:
            raise ValueError(
                f"expected input_features of shape [clips, mel bins, frames], got "
                f"{tuple(features.shape)}"
            )
        if not features.is_floating_point():
            raise ValueError(f"input_features are {features.dtype}: {name} takes log-mel floats")
        _, bins, frames = features.shape
        if bins != self.mel_bins:
            raise ValueError(f"expected {self.mel_bins} mel bins, got {bins}")
        if frames != self.frames:
            raise ValueError(
                f"{name} takes input_features of {self.frames} frames, got {frames}; pad or cut "
                f"the features to {self.frames} frames, as its feature extractor does"
            )
