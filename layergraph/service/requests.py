"""Each request's image checked as it arrives, before it joins a batch.

:class:`ImageCheck` is what :class:`~layergraph.service.ImageEncoder` runs on every item (after
``preprocess``): an item it refuses raises :class:`RequestError`, which names what is wrong and
carries the HTTP status a client should get, so that a bad request fails alone and never
reaches a batch of good ones. It does not decode, resize or normalise images: that is
``preprocess``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["ImageCheck", "RequestError", "ServiceOverloaded"]


class RequestError(ValueError):
    """A request refused for its own content: the client's mistake, never the server's.

    ``status`` is the HTTP status it maps to: 400 (the body cannot be read), 413 (too large),
    415 (not an image array), 422 (an image of the wrong shape, dtype or values).
    """

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the status across processes (Ray)
        return (type(self), (str(self), self.status))

    def to_json(self) -> dict[str, Any]:
        """The body of the error response: ``{"error": {"status": ..., "message": ...}}``."""
        return {"error": {"status": self.status, "message": str(self)}}


class ServiceOverloaded(RuntimeError):
    """A request turned away because the replica holds as many waiting requests as it takes
    (``max_queued``): the server's state, not the request's, so a client retries it
    (HTTP 503, with ``Retry-After``)."""

    status = 503
    retry_after_s = 1


IntegerImages = Literal["refuse", "scale"]
"""What :class:`ImageCheck` does with images of an integer dtype: refuse them, or ``"scale"``
8-bit pixels (``uint8``) to floats in [0, 1] (``image.float() / 255``); other integer dtypes
are refused either way."""


@dataclass(frozen=True)
class ImageCheck:
    """The checks of one image ``[C, H, W]``, in order: a tensor (or a numeric NumPy array);
    not empty; at most ``max_pixels`` pixels (413); a real floating dtype (integers per
    ``integer_images``; bool and complex refused); three dimensions; the ``shape`` an encoder
    takes, where given; only finite values, where ``require_finite``. Returns the image as a
    floating tensor."""

    shape: tuple[int, ...] | None = None
    max_pixels: int = 8192 * 8192
    require_finite: bool = True
    integer_images: IntegerImages = "refuse"

    def __post_init__(self) -> None:
        if self.integer_images not in ("refuse", "scale"):
            raise ValueError(
                f"integer_images must be 'refuse' or 'scale', got {self.integer_images!r}"
            )
        if self.shape is not None and len(self.shape) != 3:
            raise ValueError(f"shape is one image's [C, H, W], got {tuple(self.shape)}")

    def __call__(self, item: Any) -> torch.Tensor:
        image = _as_tensor(item)
        if image.numel() == 0:
            raise RequestError(f"the image is empty (shape {tuple(image.shape)})")
        if image.dim() >= 2 and image.shape[-1] * image.shape[-2] > self.max_pixels:
            raise RequestError(
                f"the image has {image.shape[-2]}x{image.shape[-1]} pixels, more than the "
                f"{self.max_pixels} this service takes",
                status=413,
            )
        image = self._floating(image)
        if image.dim() != 3:
            raise RequestError(
                f"expected one image of shape [channels, height, width], got shape "
                f"{tuple(image.shape)}"
            )
        if self.shape is not None and tuple(image.shape) != tuple(self.shape):
            raise RequestError(_shape_mismatch(tuple(image.shape), tuple(self.shape)))
        if self.require_finite and not bool(torch.isfinite(image).all()):
            raise RequestError("the image has NaN or infinite values")
        return image

    def _floating(self, image: torch.Tensor) -> torch.Tensor:
        if image.is_floating_point():
            return image
        if image.is_complex() or image.dtype == torch.bool:
            raise RequestError(f"images are {image.dtype}: send real floating-point pixels")
        if self.integer_images == "scale" and image.dtype == torch.uint8:
            return image.float() / 255
        rule = (
            "this service scales uint8 pixels only"
            if self.integer_images == "scale"
            else "send floating-point pixels, scaled and normalised as the model expects"
        )
        raise RequestError(f"images are {image.dtype}: {rule}")


def _as_tensor(item: Any) -> torch.Tensor:
    if isinstance(item, torch.Tensor):
        return item
    if type(item).__module__ == "numpy" and hasattr(item, "dtype"):
        if item.dtype.kind not in "fiucb":
            raise RequestError(
                f"expected a numeric image array, got an array of dtype {item.dtype}", status=415
            )
        return torch.from_numpy(item)
    raise RequestError(
        f"expected an image tensor or array [channels, height, width], got {type(item).__name__}",
        status=415,
    )


def _shape_mismatch(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    if got[0] != want[0]:
        return f"the image has {got[0]} channels; the encoder takes {want[0]}"
    return (
        f"image size {got[1]}x{got[2]} differs from the encoder's {want[1]}x{want[2]}; resize "
        f"it first"
    )
