"""A client of the embedding service's HTTP endpoint that retries what is safe to retry.

Embedding an image is idempotent, so a request that failed for the server's reasons (a
replica that died with it in flight, a proxy with no replica ready: a connection error, or
status 500, 502, 503 or 504) can be sent again; :class:`EmbeddingClient` does so up to
``retries`` times, waiting ``backoff_s`` (doubled each time, or the server's ``Retry-After``).
A request refused for its own content (4xx) is never retried: it raises
:class:`~layergraph.service.requests.RequestError` with the server's status and message.

Standard library only: it runs where neither PyTorch nor Ray is installed (it returns a list
of floats).
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .requests import RequestError

__all__ = ["EmbeddingClient", "ServiceUnavailable", "npy_bytes"]

RETRIED_STATUSES = frozenset({500, 502, 503, 504})
"""The statuses a request is sent again after: the server's failures, not the request's."""


class ServiceUnavailable(RuntimeError):
    """The service failed a request on every try; ``status`` is the last try's (``None`` for
    a connection error)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def npy_bytes(image: Any) -> bytes:
    """``image`` (a NumPy array, or anything with ``.numpy()``) as the bytes of a ``.npy``
    file, the body the service's default ``decode`` reads."""
    import numpy as np

    array = image.numpy() if hasattr(image, "numpy") else np.asarray(image)
    body = io.BytesIO()
    np.save(body, array, allow_pickle=False)
    return body.getvalue()


@dataclass
class EmbeddingClient:
    """Posts images to ``url`` and returns their embeddings, retrying the server's failures.

    ``encode`` makes a request's body (:func:`npy_bytes` unless given); ``timeout_s`` bounds
    each try. ``tries`` counts the requests sent, and ``retried`` those sent again.
    """

    url: str
    retries: int = 1
    backoff_s: float = 0.2
    timeout_s: float = 30.0
    encode: Callable[[Any], bytes] = npy_bytes
    tries: int = field(default=0, init=False)
    retried: int = field(default=0, init=False)

    def embed(self, image: Any) -> list[float]:
        """The embedding of ``image``. Raises
        :class:`~layergraph.service.requests.RequestError` for a request the service refused
        (4xx, never retried) and :class:`ServiceUnavailable` when every try failed."""
        body = self.encode(image)
        wait, attempt = self.backoff_s, 0
        while True:
            self.tries += 1
            status, answer, retry_after = self._post(body)
            if status == 200:
                return answer["embedding"]
            message = _message(answer, status)
            if status is not None and status not in RETRIED_STATUSES:
                raise RequestError(message, status)
            if attempt == self.retries:
                raise ServiceUnavailable(
                    f"the service failed the request {attempt + 1} times; last: {message}", status
                )
            time.sleep(retry_after if retry_after is not None else wait)
            wait, attempt = wait * 2, attempt + 1
            self.retried += 1

    def _post(self, body: bytes) -> tuple[int | None, Any, float | None]:
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, json.loads(response.read()), None
        except urllib.error.HTTPError as error:
            retry_after = error.headers.get("Retry-After")
            return error.code, _json(error.read()), _seconds(retry_after)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            return None, {"error": {"message": f"connection failed: {error}"}}, None


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"error": {"message": raw.decode(errors="replace")[:500]}}


def _message(answer: Any, status: int | None) -> str:
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message or f"status {status}"


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
