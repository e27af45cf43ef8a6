"""The sequence of a vision tower's key: tokens per image (or per tile), and the image size."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ImageTokens", "TileTokens"]


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
