"""The sequence of a vision tower's key: tokens per image, and the image size that gives them."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ImageTokens"]


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
