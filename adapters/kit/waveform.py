"""The plan of raw-waveform speech encoders: wav2vec 2.0, HuBERT and WavLM.

These take ``input_values`` (``[clips, samples]``, 16 kHz audio) and an optional
``attention_mask`` over the samples; a stack of convolutions makes one frame per 320 samples,
then come the feature projection, a convolutional position embedding and the layers. Their
graphs are keyed by (clips, samples), as an image tower's by (images, image size).

A call's length is served two ways:

- **exact** (the default, ``length_step=None``): one graph per length, the measured policy
  serving eagerly the lengths whose graphs do not pay;
- **padded**, where ``length_step`` is given, for the models whose answer padding keeps
  (those that normalise each frame, ``feat_extract_norm="layer"``, whose feature extractors
  give an attention mask): the samples are padded with zeros to a multiple of
  ``length_step`` and masked, and each output cut back to the call's frames, so that clips of
  many lengths share a few graphs. The others (``feat_extract_norm="group"`` normalises over
  the whole clip, so padding changes every frame) keep exact lengths.

The encoders' masks are made with assignments a CUDA graph cannot capture as written (a
boolean-mask assignment reads the mask on the host; a number assigned by index is copied from
the host); while the graphs are captured they are computed otherwise
(:class:`MaskedAssignment`), the same values.

What this does not do: change any output's values past rounding, or pad a call that asks for
attention weights (it runs as given).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from layergraph.keys import CallInputs
from layergraph_adapters.kit.hf_vision import VisionTowerPlan

__all__ = ["SAMPLE_RATE", "MaskedAssignment", "Samples", "WaveformPlan", "waveforms"]

SAMPLE_RATE = 16000
"""The sampling rate of every served checkpoint's feature extractor."""


class Samples(NamedTuple):
    """The sequence of a waveform encoder's key: frames per clip, and the samples that make
    them."""

    frames: int
    samples: int

    def __str__(self) -> str:
        return f"{self.frames} frames ({self.samples} samples)"


def waveforms(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """``input_values``: ``batch`` clips of random audio of one second (``size`` is not
    read)."""
    return {"input_values": torch.randn(batch, SAMPLE_RATE, dtype=dtype, device=device)}


class MaskedAssignment(TorchFunctionMode):
    """Computes the encoders' assignments the way a CUDA graph captures them: ``tensor[mask] =
    value`` (a boolean ``mask`` of the tensor's shape) as ``tensor.masked_fill_(mask, value)``,
    which reads nothing on the host; and a number assigned to a device tensor by any index
    (``mask[(rows, lengths - 1)] = 1``) from a number made on the device, not copied from the
    host. The same values; anything else runs as it is."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not torch.Tensor.__setitem__ or len(args) != 3:
            return func(*args, **(kwargs or {}))
        target, index, value = args
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
            value = value.item()
        if (
            isinstance(index, torch.Tensor)
            and index.dtype == torch.bool
            and index.shape == target.shape
            and (not isinstance(value, torch.Tensor) or value.numel() == 1)
        ):
            target.masked_fill_(index, value)  # a number: a kernel argument, no copy
            return None
        if isinstance(value, (bool, int, float)) and target.device.type != "cpu":
            value = torch.full((), value, dtype=target.dtype, device=target.device)
        return func(target, index, value)


class WaveformPlan(VisionTowerPlan):
    """A raw-waveform speech encoder's whole forward, keyed by (clips, samples)."""

    length_step: int | None = None
    """Padded calls' samples are a multiple of it (where :attr:`pads` allows); ``None``: exact
    lengths. The adapter's ``length_step`` sets it."""

    def read_geometry(self, config: Any) -> None:
        self.pads_keep_answers: bool = config.feat_extract_norm == "layer"
        """Whether padding with a mask keeps the answer (frames normalised one by one)."""

    @property
    def pads(self) -> bool:
        """Whether calls are padded to a multiple of :attr:`length_step`."""
        return self.pads_keep_answers and self.length_step is not None

    def frames(self, samples: int) -> int:
        """The frames the encoder makes of a clip of ``samples``."""
        return int(self.owner._get_feat_extract_output_lengths(samples))

    def sequence_of(self, call: CallInputs) -> Hashable:
        samples = call.tensors[0].shape[-1]
        return Samples(self.frames(samples), samples)

    def check_inputs(self, call: CallInputs) -> None:
        values = call.argument("input_values", 0)
        name = type(self.owner).__name__
        if not isinstance(values, torch.Tensor) or values.dim() != 2:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else values
            raise ValueError(f"{name} takes input_values of shape [clips, samples], got {shape}")
        if not values.is_floating_point():
            raise ValueError(f"input_values are {values.dtype}: {name} takes audio samples")
        if self.frames(values.shape[1]) < 1:
            raise ValueError(
                f"{values.shape[1]} samples make no frame: {name} takes clips of at least "
                f"{self._shortest()} samples"
            )
        mask = call.argument("attention_mask", 1)
        if isinstance(mask, torch.Tensor) and mask.shape != values.shape:
            raise ValueError(
                f"attention_mask {tuple(mask.shape)} does not match input_values "
                f"{tuple(values.shape)}"
            )

    def _shortest(self) -> int:
        samples = 1
        while self.frames(samples) < 1:
            samples += 1
        return samples

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask", args[1] if len(args) > 1 else None) is None:
            return super().region(*args, **kwargs)  # no mask: no assignment to rewrite
        with MaskedAssignment():
            return super().region(*args, **kwargs)

    def _tower_forward(self, serve: Callable[..., Any]) -> Callable[..., Any]:
        """The encoder's forward while wrapped: calls padded to a multiple of
        :attr:`length_step` and masked, their outputs cut back (where :attr:`pads`); the
        others as given."""
        given = super()._tower_forward(serve)

        def forward(*args: Any, **kwargs: Any) -> Any:
            values = kwargs.get("input_values", args[0] if args else None)
            if (
                not self.pads
                or len(args) > 2
                or kwargs.get("output_attentions")
                or not isinstance(values, torch.Tensor)
                or values.dim() != 2
            ):
                return given(*args, **kwargs)
            samples = values.shape[1]
            padded = math.ceil(samples / self.length_step) * self.length_step
            if padded == samples or self.frames(samples) < 1:  # the latter refused as given
                return given(*args, **kwargs)
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            if mask is None:
                mask = torch.ones(values.shape, dtype=torch.long, device=values.device)
            rest = {k: v for k, v in kwargs.items() if k not in ("input_values", "attention_mask")}
            out = given(
                F.pad(values, (0, padded - samples)),
                attention_mask=F.pad(mask, (0, padded - samples)),
                **rest,
            )
            return _cut_frames(out, self.frames(padded), self.frames(samples))

        return forward


def _cut_frames(out: Any, padded: int, frames: int) -> Any:
    """``out`` with every tensor of ``padded`` frames (its second dimension) cut to
    ``frames``."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] == padded:
            return leaf[:, :frames]
        return leaf

    if hasattr(out, "keys") and not isinstance(out, dict):  # a transformers ModelOutput
        return type(out)(**{name: pytree.tree_map(cut, value) for name, value in out.items()})
    return pytree.tree_map(cut, out)
