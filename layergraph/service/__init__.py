"""Serving an image encoder: one wrapped encoder per process, fed lists of images.

:class:`ImageEncoder` builds a model, wraps it, starts from a warm-start file and captures the
batch sizes asked for before it takes traffic; each call embeds a list of images in one batch
and returns one CPU tensor per image. :class:`MicroBatcher` forms those lists from concurrent
requests (a batch forms when the encoder is free, and closes when full or a window after its
first request); the Ray deployment batches with it too. :class:`EmbedBatches` is the
class-based callable of a Ray Data ``map_batches`` job. None of them imports Ray;
:mod:`layergraph.service.ray` holds the Ray Serve deployment.

Every item is checked as it arrives (:meth:`ImageEncoder.prepare`, by
:class:`~layergraph.service.requests.ImageCheck`), before it joins a batch: a bad request fails
alone with a :class:`~layergraph.service.requests.RequestError` naming what is wrong and the
HTTP status a client gets. A batch that fails all the same is handled again one item at a
time, so that only the items that fail alone fail.

What this module does not do: decode or resize images (give ``preprocess``, or send tensors),
spread one encoder over several GPUs, or batch across processes.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from ..module import GraphedModule, wrap
from .requests import ImageCheck, RequestError, ServiceOverloaded

__all__ = [
    "EmbedBatches",
    "ImageCheck",
    "ImageEncoder",
    "MicroBatcher",
    "RequestError",
    "ServiceOverloaded",
    "default_embed",
]

Item = TypeVar("Item")
Result = TypeVar("Result")


def default_embed(model: nn.Module, images: Any) -> torch.Tensor:
    """The image embeddings of a batch by what the model offers, in this order:
    ``encode`` of a ``SentenceTransformer`` (``images`` as its ``encode`` takes them),
    ``encode_image`` (open_clip), ``get_image_features`` (transformers; its
    ``pooler_output`` where it returns an output object), else the model's own call (its
    output, or the first tensor of a tuple or output object)."""
    if type(model).__name__ == "SentenceTransformer" and hasattr(model, "encode"):
        return model.encode(images, batch_size=len(images), convert_to_tensor=True)
    if hasattr(model, "encode_image"):
        return model.encode_image(images)
    if hasattr(model, "get_image_features"):
        output = model.get_image_features(pixel_values=images)
        return output if isinstance(output, torch.Tensor) else output.pooler_output
    output = model(images)
    if isinstance(output, torch.Tensor):
        return output
    first = output[0] if isinstance(output, (tuple, list)) else output.to_tuple()[0]
    return first


class ImageEncoder:
    """A model built, wrapped and ready to embed batches of images in one process.

    ``build()`` makes the model (weights loaded, on its device and dtype): it is called here,
    so a Ray actor or a worker process builds its own. ``embed(model, images)`` turns a batch
    into embeddings (:func:`default_embed` unless given; ``model`` is the wrapper, or the
    model itself with ``graphed=False``, the eager twin for comparisons). ``preprocess`` maps
    each request's item to an image tensor ``[C, H, W]`` (identity unless given). Images are
    stacked and moved to the model's device and dtype; items that are not tensors after
    ``preprocess`` (PIL images for a ``SentenceTransformer``) go to ``embed`` as a list.

    ``warm_start`` names a file from :meth:`save_warm_start` (another process's
    measurements and compiled kernels); ``capture`` lists batch sizes to capture now, from a
    random example of ``image_shape``, so that the first requests replay graphs (for a model
    off the GPU, and no ``backend`` given, nothing is captured: its calls run eagerly, as
    :meth:`report` says). ``check`` is what every image tensor or array must pass
    (:class:`~layergraph.service.requests.ImageCheck`; by default one of ``image_shape``
    where given, finite values, no integer pixels). Other keyword arguments go to
    :func:`layergraph.wrap`.
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        embed: Callable[[nn.Module, Any], torch.Tensor] = default_embed,
        preprocess: Callable[[Any], Any] | None = None,
        graphed: bool = True,
        warm_start: str | os.PathLike[str] | None = None,
        capture: Sequence[int] = (),
        image_shape: Sequence[int] | None = None,
        check: ImageCheck | None = None,
        **wrap_options: Any,
    ) -> None:
        if capture and image_shape is None:
            raise ValueError("capture needs image_shape, the [C, H, W] of one image")
        self.check = check or ImageCheck(shape=tuple(image_shape) if image_shape else None)
        """What every image tensor or array is checked against, as it arrives."""
        self.model = build().eval()
        self._embed = embed
        self._takes_other_items = (
            embed is not default_embed or type(self.model).__name__ == "SentenceTransformer"
        )
        """Whether items that are no tensor or array go to ``embed`` as they are (a
        ``SentenceTransformer`` reads PIL images; a custom ``embed`` what it takes)."""
        self._preprocess = preprocess
        parameter = next(self.model.parameters(), None)
        self.device = parameter.device if parameter is not None else torch.device("cpu")
        self.dtype = parameter.dtype if parameter is not None else torch.float32
        self.graphed: GraphedModule | None = None
        if graphed:
            self.graphed = wrap(self.model, warm_start=warm_start, **wrap_options)
        elif warm_start is not None or wrap_options:
            raise ValueError("warm_start and wrap options need graphed=True")
        if capture and (self.device.type == "cuda" or "backend" in wrap_options):
            assert self.graphed is not None and image_shape is not None
            example = torch.randn(1, *image_shape, device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                self.graphed.capture(example, batch_sizes=list(capture), progress=False)
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size were embedded."""

    @property
    def serving(self) -> nn.Module:
        """What calls go to: the wrapper, or the model itself with ``graphed=False``."""
        return self.graphed if self.graphed is not None else self.model

    def prepare(self, item: Any) -> Any:
        """One request's item, preprocessed and checked: an image tensor ``[C, H, W]``, or,
        for a ``SentenceTransformer`` or a custom ``embed``, what ``preprocess`` made of it
        where that is no tensor or array (a PIL image), as it is. Raises
        :class:`~layergraph.service.requests.RequestError` naming what is wrong."""
        if self._preprocess is not None:
            try:
                item = self._preprocess(item)
            except RequestError:
                raise
            except Exception as error:
                raise RequestError(f"preprocess could not read the item: {error}") from error
        if self._takes_other_items and not (
            isinstance(item, torch.Tensor) or type(item).__module__ == "numpy"
        ):
            return item
        return self.check(item)

    def __call__(self, images: torch.Tensor | Sequence[Any]) -> torch.Tensor:
        """The embeddings of a batch (a tensor ``[N, C, H, W]`` or a list of items), as one
        float32 CPU tensor of ``N`` rows; each item goes through :meth:`prepare` first (a
        :class:`~layergraph.service.requests.RequestError` names the first bad one)."""
        if isinstance(images, torch.Tensor) and images.dim() != 4:
            raise RequestError(
                f"expected a batch of images [N, C, H, W], got shape {tuple(images.shape)}"
            )
        rows = list(images)
        items = []
        for index, item in enumerate(rows):
            try:
                items.append(self.prepare(item))
            except RequestError as error:
                raise RequestError(f"image {index}: {error}", error.status) from error
        return self.embed_prepared(items)

    def embed_prepared(self, items: Sequence[Any]) -> torch.Tensor:
        """The embeddings of items :meth:`prepare` returned, as one float32 CPU tensor."""
        if items and all(isinstance(item, torch.Tensor) for item in items):
            batch: Any = torch.stack(list(items))
        else:
            batch = list(items)
        if isinstance(batch, torch.Tensor):
            batch = batch.to(self.device, self.dtype, non_blocking=True)
        self.batch_sizes[len(batch)] += 1
        with torch.inference_mode():
            embeddings = self._embed(self.serving, batch)
        return embeddings.float().cpu()

    def report(self) -> dict[str, Any]:
        """What this encoder served, in plain values (for a replica to report): batches by
        size, graphs held, replays, and eager calls by reason."""
        stats = self.graphed.stats if self.graphed is not None else None
        return {
            "batch_sizes": dict(self.batch_sizes),
            "graphs": stats.graphs if stats is not None else 0,
            "replays": stats.replays if stats is not None else 0,
            "eager_calls": dict(stats.eager_calls) if stats is not None else {},
        }

    def embed_list(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """The embedding of each item, in order: the body of a batching method."""
        return list(self(items).unbind(0))

    def embed_prepared_list(self, items: Sequence[Any]) -> list[torch.Tensor]:
        """The embedding of each item :meth:`prepare` returned, in order: the ``handle`` of a
        :class:`MicroBatcher` whose ``check`` is :meth:`prepare`."""
        return list(self.embed_prepared(items).unbind(0))

    def save_warm_start(self, path: str | os.PathLike[str]) -> int:
        """Write this encoder's measurements and compiled kernels to ``path``, for the
        ``warm_start`` of other replicas (:meth:`layergraph.GraphedModule.save_warm_start`);
        returns the bytes written."""
        if self.graphed is None:
            raise ValueError("an encoder made with graphed=False has no warm start to save")
        return self.graphed.save_warm_start(path)


@dataclass
class _Pending(Generic[Item, Result]):
    item: Item
    done: asyncio.Future[Result]
    arrived: float
    """When the item was submitted, by the event loop's clock."""


@dataclass
class MicroBatcher(Generic[Item, Result]):
    """Dynamic batching for one event loop: concurrent :meth:`submit` calls are grouped into
    lists for ``handle``, one batch at a time, run in a worker thread so the loop keeps taking
    requests meanwhile.

    A batch forms only when ``handle`` is free: the items that arrived while the last batch
    was handled join the next at once (Ray Serve's ``@serve.batch`` forms the next batch while
    one is handled, so under load its batches hold what arrived within one window). A batch
    closes when it holds ``max_batch_size`` items or ``batch_wait_timeout_s`` after its first
    item arrived; where requests arrive further apart than that window (traffic too sparse
    to batch), a lone request is handled at once rather than held for the window. ``check``
    (an encoder's :meth:`ImageEncoder.prepare`, say) runs on each item in :meth:`submit`,
    before it joins a batch: what it raises reaches that caller only, and what it returns is
    the item batched.
    ``handle`` returns one result per item; where it raises for a batch of several, each item
    is handled again alone, so that its exception reaches only the callers whose items fail
    alone (``handle`` must be safe to call again on the same items, as embedding is).
    """

    handle: Callable[[list[Item]], list[Result]]
    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.005
    check: Callable[[Any], Item] | None = None
    max_queued: int | None = None
    """At most this many items wait for a batch; :meth:`submit` raises
    :class:`~layergraph.service.requests.ServiceOverloaded` beyond (``None``: no bound)."""
    batch_sizes: Counter[int] = field(default_factory=Counter)
    """How many batches of each size were handled."""
    _queue: asyncio.Queue[_Pending[Item, Result]] | None = field(default=None, repr=False)
    _worker: asyncio.Task[None] | None = field(default=None, repr=False)
    _last_arrival: float | None = field(default=None, repr=False)
    _gap: float | None = field(default=None, repr=False)
    """The moving average of the time between arrivals (seconds)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {self.max_queued}")
        if self.batch_wait_timeout_s < 0:
            raise ValueError(
                f"batch_wait_timeout_s must be 0 or more, got {self.batch_wait_timeout_s}"
            )

    async def submit(self, item: Any) -> Result:
        """The result of ``item``, once the batch it joined was handled."""
        if self.check is not None:
            item = self.check(item)
        waiting = self._queue.qsize() if self._queue is not None else 0
        if self.max_queued is not None and waiting >= self.max_queued:
            raise ServiceOverloaded(
                f"{waiting} requests are waiting, as many as this replica takes; retry in "
                f"{ServiceOverloaded.retry_after_s} s"
            )
        if self._queue is None or self._worker is None or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._serve(self._queue))
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._last_arrival is not None:
            gap = now - self._last_arrival
            self._gap = gap if self._gap is None else (self._gap + gap) / 2
        self._last_arrival = now
        done: asyncio.Future[Result] = loop.create_future()
        await self._queue.put(_Pending(item, done, now))
        return await done

    async def close(self) -> None:
        """Stop the batching task (pending requests are cancelled)."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    async def _serve(self, queue: asyncio.Queue[_Pending[Item, Result]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            sparse = self._gap is None or self._gap >= self.batch_wait_timeout_s
            deadline = batch[0].arrived + (0.0 if sparse else self.batch_wait_timeout_s)
            while len(batch) < self.max_batch_size:
                if not queue.empty():
                    batch.append(queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), left))
                except asyncio.TimeoutError:
                    break
            self.batch_sizes[len(batch)] += 1
            try:
                results = await self._handled(batch)
            except Exception as error:
                if len(batch) == 1:
                    _settle(batch[0], error=error)
                    continue
                for pending in batch:  # each alone: only the items that fail alone fail
                    try:
                        _settle(pending, result=(await self._handled([pending]))[0])
                    except Exception as alone:
                        _settle(pending, error=alone)
                continue
            for pending, result in zip(batch, results):
                _settle(pending, result=result)

    async def _handled(self, batch: list[_Pending[Item, Result]]) -> list[Result]:
        results = await asyncio.to_thread(self.handle, [p.item for p in batch])
        if len(results) != len(batch):
            raise ValueError(
                f"the batch handler returned {len(results)} results for {len(batch)} items"
            )
        return results


def _settle(
    pending: _Pending[Any, Any], result: Any = None, error: Exception | None = None
) -> None:
    if pending.done.done():
        return
    if error is not None:
        pending.done.set_exception(error)
    else:
        pending.done.set_result(result)


class EmbedBatches:
    """The class-based callable of a Ray Data job:
    ``dataset.map_batches(EmbedBatches, fn_constructor_kwargs=..., num_gpus=1)``. Each actor
    builds one :class:`ImageEncoder` (the constructor's keyword arguments); each batch's
    ``column`` (an array ``[N, C, H, W]``, or a list of items for ``preprocess``) is embedded
    into ``output_column`` as a float32 array ``[N, D]``; the other columns pass through.
    Ray Data's batches of any size, the last one included, are served by the wrapper's
    measured shape policy.
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        column: str = "image",
        output_column: str = "embedding",
        **encoder_options: Any,
    ) -> None:
        self.column = column
        self.output_column = output_column
        self.encoder = ImageEncoder(build, **encoder_options)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.column not in batch:
            raise KeyError(
                f"the batch has no column {self.column!r} (it has {', '.join(map(repr, batch))})"
            )
        images = batch[self.column]
        if type(images).__module__ == "numpy" and images.dtype.kind in "fiucb":
            images = torch.from_numpy(images)
        return {**batch, self.output_column: self.encoder(images).numpy()}
