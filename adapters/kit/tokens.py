"""The sequence of a vision tower's key: tokens per image (or per tile), and the image size;
and the check of a call's one image batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from layergraph.keys import CallInputs

__all__ = ["ImageSize", "ImageTokens", "TileTokens", "check_floating", "checked_images"]


class ImageTokens(NamedTuple):
    """Tokens per image, and the image size that gives them.

    Two image sizes with the same token count (56x70 and 70x56) are different keys, and print
    differently in ``graphed.keys`` and statistics.
    """

    tokens: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens ({self.height}x{self.width})"


class ImageSize(NamedTuple):
    """The image size, the sequence of a model that has no tokens to count (a convnet, a model
    of stages that pool as they go)."""

    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.height}x{self.width} images"


class TileTokens(NamedTuple):
    """Images per row of a tiled call, tiles per image, tokens per tile, and the tile size.

    The sequence of a tower that takes each image as a fixed number of tiles (Mllama).
    """

    images: int
    tiles: int
    tokens: int
    height: int
    width: int

    def __str__(self) -> str:
        return (
            f"{self.images} image(s) x {self.tiles} tiles x {self.tokens} tokens "
            f"({self.height}x{self.width})"
        )


def checked_images(call: CallInputs, channels: int) -> torch.Tensor:
    """The one image batch of ``call``, ``[batch, channels, height, width]``; ``ValueError``
    naming what is wrong otherwise (another count of tensors, rank, channel count, or integer
    pixels). Image
    sizes are the caller's to check."""
    if len(call.tensors) != 1:
        raise ValueError(f"expected one image tensor, got {len(call.tensors)} tensors")
    images = call.tensors[0]
    if images.dim() != 4:
        raise ValueError(
            f"expected images of shape [batch, channels, height, width], got {tuple(images.shape)}"
        )
    if images.shape[1] != channels:
        raise ValueError(f"expected {channels} channels, got {images.shape[1]}")
    check_floating(images)
    return images


_IMAGE_CONVERSION = (
    ", scaled and normalised as its preprocessing does (for 8-bit pixels, images.float() / "
    "255, then its mean and std)"
)


def check_floating(images: torch.Tensor, what: str = "images") -> None:
    """``ValueError`` for images (or another input, ``what``) of an integer dtype, naming the
    conversion images need."""
    if not images.is_floating_point():
        how = _IMAGE_CONVERSION if what == "images" else ""
        raise ValueError(f"{what} are {images.dtype}: the model takes floating-point {what}{how}")
