"""Ray Serve: a deployment whose ``@serve.batch`` method feeds a wrapped image encoder.

Each replica builds one :class:`~layergraph.service.ImageEncoder` in its constructor (from a
warm-start file and with the batch sizes to capture, when given), so it takes traffic with its
graphs ready; Ray Serve's dynamic batching hands the encoder lists of any size up to
``max_batch_size``, which the wrapper's measured shape policy serves. Python callers use
``handle.embed.remote(image)``; HTTP callers post one image as a ``.npy`` array (or what
``decode`` reads) and get ``{"embedding": [...]}``. The Ray Data callable is
:class:`layergraph.service.EmbedBatches`, which needs no Ray import.

Needs Ray Serve: ``pip install 'layergraph[ray]'``.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import EmbedBatches, ImageEncoder

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "layergraph.service.ray needs Ray Serve: pip install 'layergraph[ray]'"
    ) from error

__all__ = ["EmbedBatches", "EncoderDeployment", "decode_npy"]


def decode_npy(body: bytes) -> torch.Tensor:
    """One image from the bytes of a ``.npy`` file (no pickled objects)."""
    import numpy as np

    return torch.from_numpy(np.load(io.BytesIO(body), allow_pickle=False))


@serve.deployment(max_ongoing_requests=128)
class EncoderDeployment:
    """A replica serving one wrapped image encoder.

    ``build`` makes the model in the replica (a module-level function, so Ray can send it);
    ``max_batch_size`` and ``batch_wait_timeout_s`` set ``@serve.batch`` (keep the
    deployment's ``max_ongoing_requests`` at least ``max_batch_size``); ``decode`` reads an
    HTTP request's body; the other keyword arguments go to
    :class:`~layergraph.service.ImageEncoder` (``warm_start``, ``capture``, ``image_shape``,
    ``preprocess``, ``embed`` and :func:`layergraph.wrap`'s options).
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        max_batch_size: int = 32,
        batch_wait_timeout_s: float = 0.005,
        decode: Callable[[bytes], Any] = decode_npy,
        **encoder_options: Any,
    ) -> None:
        self.encoder = ImageEncoder(build, **encoder_options)
        self.decode = decode
        self.embed.set_max_batch_size(max_batch_size)
        self.embed.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def embed(self, images: list[Any]) -> list[torch.Tensor]:
        """The embedding of one image; Ray Serve calls this with the batch it formed."""
        return await asyncio.to_thread(self.encoder.embed_list, images)

    def report(self) -> dict[str, Any]:
        """What this replica served (:meth:`~layergraph.service.ImageEncoder.report`)."""
        return self.encoder.report()

    async def __call__(self, request: Any) -> dict[str, list[float]]:
        image = self.decode(await request.body())
        embedding = await self.embed(image)
        return {"embedding": embedding.tolist()}
