"""Ray Serve: a deployment whose replicas batch requests for a wrapped image encoder.

Each replica builds one :class:`~layergraph.service.ImageEncoder` in its constructor (from a
warm-start file and with the batch sizes to capture, when given), so it takes traffic with its
graphs ready; a :class:`~layergraph.service.MicroBatcher` hands the encoder lists of any size
up to ``max_batch_size``, which the wrapper's measured shape policy serves. It batches rather
than Ray Serve's ``@serve.batch``, which forms the next batch while one is embedded, so that
under load its batches held only the requests of one window. Python callers use
``handle.embed.remote(image)``; HTTP callers post one image as a ``.npy`` array (or what
``decode`` reads) and get ``{"embedding": [...]}``. The Ray Data callable is
:class:`layergraph.service.EmbedBatches`, which needs no Ray import.

Each image is checked before it joins a batch (:meth:`ImageEncoder.prepare
<layergraph.service.ImageEncoder.prepare>`), so a bad request fails alone: through a handle
with a :class:`~layergraph.service.requests.RequestError`, over HTTP with its status (400 for
a body that cannot be read, 413 for one above ``max_body_bytes``, 415 or 422 for an image that
is not what the encoder takes) and a JSON body ``{"error": {"status": ..., "message": ...}}``.
A replica holding ``max_queued`` waiting requests turns more away with a 503 and
``Retry-After`` (the client's to retry); any other failure is a 500 with the same JSON form.
Responses are strict JSON: an embedding with a non-finite value is a 500.

Needs Ray Serve: ``pip install 'layergraph[ray]'``.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import EmbedBatches, ImageEncoder, MicroBatcher
from .requests import RequestError, ServiceOverloaded

try:
    from ray import serve
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "layergraph.service.ray needs Ray Serve: pip install 'layergraph[ray]'"
    ) from error

__all__ = ["EmbedBatches", "EncoderDeployment", "decode_npy"]

_log = logging.getLogger(__name__)


def decode_npy(body: bytes) -> torch.Tensor:
    """One image from the bytes of a ``.npy`` file (no pickled objects);
    :class:`~layergraph.service.requests.RequestError` (400) for bytes that are not one."""
    import numpy as np

    if not body:
        raise RequestError("the request has no body: post one image as a .npy array", 400)
    try:
        array = np.load(io.BytesIO(body), allow_pickle=False)
    except Exception as error:
        raise RequestError(f"the body is not a .npy array: {error}", 400) from error
    if array.dtype.kind not in "fiucb":
        raise RequestError(f"expected a numeric image array, got dtype {array.dtype}", 415)
    return torch.from_numpy(array)


def _response(body: dict[str, Any], status: int, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(
        json.dumps(body, allow_nan=False),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


@serve.deployment(max_ongoing_requests=128)
class EncoderDeployment:
    """A replica serving one wrapped image encoder.

    ``build`` makes the model in the replica (a module-level function, so Ray can send it);
    ``max_batch_size`` and ``batch_wait_timeout_s`` set the replica's
    :class:`~layergraph.service.MicroBatcher` (keep the deployment's ``max_ongoing_requests``
    at least ``max_batch_size``); ``decode`` reads an
    HTTP request's body (raising :class:`~layergraph.service.requests.RequestError` for one
    it cannot read); ``max_body_bytes`` bounds a body's size, ``max_queued`` the requests
    waiting for a batch (beyond: 503); the other keyword arguments go
    to :class:`~layergraph.service.ImageEncoder` (``warm_start``, ``capture``,
    ``image_shape``, ``check``, ``preprocess``, ``embed`` and :func:`layergraph.wrap`'s
    options).
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        max_batch_size: int = 32,
        batch_wait_timeout_s: float = 0.005,
        decode: Callable[[bytes], Any] = decode_npy,
        max_body_bytes: int = 64 * 2**20,
        max_queued: int | None = None,
        **encoder_options: Any,
    ) -> None:
        self.encoder = ImageEncoder(build, **encoder_options)
        self.decode = decode
        self.max_body_bytes = max_body_bytes
        self.batcher = MicroBatcher(
            self.encoder.embed_prepared_list,
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=batch_wait_timeout_s,
            check=self.encoder.prepare,
            max_queued=max_queued,
        )
        """The replica's batching: a batch forms when the encoder is free."""

    async def embed(self, image: Any) -> torch.Tensor:
        """The embedding of one image, checked before it joins a batch; raises
        :class:`~layergraph.service.requests.RequestError` for a bad one."""
        return await self.batcher.submit(image)

    def report(self) -> dict[str, Any]:
        """What this replica served (:meth:`~layergraph.service.ImageEncoder.report`)."""
        return self.encoder.report()

    async def __call__(self, request: Any) -> Any:
        try:
            length = int(request.headers.get("content-length") or 0)
            if length > self.max_body_bytes:
                raise RequestError(
                    f"the body has {length} bytes, more than the {self.max_body_bytes} this "
                    f"service takes",
                    413,
                )
            embedding = await self.embed(self.decode(await request.body()))
            values = embedding.tolist()
            if not all(math.isfinite(value) for value in values):
                raise ValueError("the embedding has non-finite values")
        except RequestError as error:
            return _response(error.to_json(), error.status)
        except ServiceOverloaded as error:
            body = {"error": {"status": 503, "message": str(error)}}
            return _response(body, 503, {"Retry-After": str(error.retry_after_s)})
        except Exception as error:
            _log.exception("an embedding request failed")
            message = f"the server failed: {type(error).__name__}: {error}"
            return _response({"error": {"status": 500, "message": message}}, 500)
        return _response({"embedding": values}, 200)
