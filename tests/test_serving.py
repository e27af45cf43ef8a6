"""layergraph.service without Ray: an ImageEncoder's embeddings against the model's own on fresh
random images (graphs simulated on the CPU, float32, so within 1e-5), graphs captured before
traffic and started from a warm-start file, the MicroBatcher's batches under concurrent
requests, and the Ray Data callable on numpy batches."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from layergraph.service import (
    EmbedBatches,
    ImageCheck,
    ImageEncoder,
    MicroBatcher,
    RequestError,
    ServiceOverloaded,
)
from layergraph.testing import SimulatedGraphs

timm = pytest.importorskip("timm")

TOLERANCE = 1e-5
SHAPE = (3, 32, 32)


@pytest.fixture(scope="module")
def build(saved_vit_builder: Any) -> Any:
    return saved_vit_builder


def eager(build: Any, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return build().eval()(images)


def test_embeddings_equal_the_models_own_and_come_from_graphs(build: Any) -> None:
    encoder = ImageEncoder(build, backend=SimulatedGraphs())
    for batch in (3, 1, 5):
        images = torch.randn(batch, *SHAPE)
        got = encoder.embed_list(list(images))
        assert len(got) == batch
        torch.testing.assert_close(
            torch.stack(got), eager(build, images), rtol=TOLERANCE, atol=TOLERANCE
        )
    report = encoder.report()
    assert report["batch_sizes"] == {3: 1, 1: 1, 5: 1}
    assert report["replays"] == 3 and report["graphs"] == 3 and report["eager_calls"] == {}


def test_capture_makes_graphs_before_the_first_request(build: Any) -> None:
    backend = SimulatedGraphs()
    encoder = ImageEncoder(
        build, capture=[1, 4], image_shape=SHAPE, backend=backend, batch_sizes=[1, 4]
    )
    assert backend.captures == 2
    encoder(torch.randn(4, *SHAPE))
    assert backend.captures == 2 and backend.replays == 1


def test_capture_off_the_gpu_is_left_out_and_calls_run_eagerly(build: Any) -> None:
    encoder = ImageEncoder(build, capture=[1, 4], image_shape=SHAPE)
    images = torch.randn(2, *SHAPE)
    torch.testing.assert_close(encoder(images), eager(build, images))
    report = encoder.report()
    assert report["graphs"] == 0 and sum(report["eager_calls"].values()) == 1


def test_capture_without_an_image_shape_is_refused(build: Any) -> None:
    with pytest.raises(ValueError, match="image_shape"):
        ImageEncoder(build, capture=[1])


def test_a_replica_starts_from_another_ones_warm_start(build: Any, tmp_path: Path) -> None:
    first = ImageEncoder(build, backend=SimulatedGraphs(eager_ms=lambda rows: 1.0))
    first(torch.randn(2, *SHAPE))
    path = tmp_path / "encoder.warm"
    assert first.save_warm_start(path) > 0
    assert first.graphed is not None
    measured = first.graphed.stats.costs
    second = ImageEncoder(build, warm_start=path, backend=SimulatedGraphs())
    assert second.graphed is not None and second.graphed.stats.costs == measured


def test_the_eager_twin_needs_no_wrapper(build: Any) -> None:
    encoder = ImageEncoder(build, graphed=False)
    images = torch.randn(2, *SHAPE)
    torch.testing.assert_close(encoder(images), eager(build, images))
    with pytest.raises(ValueError, match="graphed=True"):
        ImageEncoder(build, graphed=False, warm_start="x")


def test_preprocess_maps_each_item_before_stacking(build: Any) -> None:
    encoder = ImageEncoder(build, backend=SimulatedGraphs(), preprocess=torch.from_numpy)
    arrays = [np.random.rand(*SHAPE).astype(np.float32) for _ in range(3)]
    want = eager(build, torch.from_numpy(np.stack(arrays)))
    torch.testing.assert_close(torch.stack(encoder.embed_list(arrays)), want)


def test_micro_batcher_groups_concurrent_requests_up_to_the_maximum() -> None:
    seen: list[int] = []

    def handle(items: list[int]) -> list[int]:
        seen.append(len(items))
        return [item * 10 for item in items]

    async def main() -> list[int]:
        batcher = MicroBatcher(handle, max_batch_size=4, batch_wait_timeout_s=0.05)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
        await batcher.close()
        return list(results)

    assert asyncio.run(main()) == [i * 10 for i in range(10)]
    assert seen == [4, 4, 2]


def test_micro_batcher_closes_a_partial_batch_after_the_timeout() -> None:
    seen: list[int] = []

    def handle(items: list[str]) -> list[str]:
        seen.append(len(items))
        return items

    async def main() -> None:
        batcher = MicroBatcher(handle, max_batch_size=8, batch_wait_timeout_s=0.01)
        assert await batcher.submit("a") == "a"
        await asyncio.sleep(0.05)
        assert await asyncio.gather(batcher.submit("b"), batcher.submit("c")) == ["b", "c"]
        await batcher.close()

    asyncio.run(main())
    assert seen == [1, 2]


def test_micro_batcher_batches_what_arrived_while_the_handler_was_busy() -> None:
    """Requests arriving while a batch is handled form the next batch together, however far
    apart within that time (a batch formed while one is handled would close one window
    after its first)."""
    seen: list[int] = []

    def handle(items: list[int]) -> list[int]:
        seen.append(len(items))
        time.sleep(0.1)
        return items

    async def main() -> None:
        batcher = MicroBatcher(handle, max_batch_size=16, batch_wait_timeout_s=0.005)
        first = asyncio.ensure_future(batcher.submit(0))
        later = []
        for item in range(1, 9):
            await asyncio.sleep(0.008)  # further apart than the window, within the handling
            later.append(asyncio.ensure_future(batcher.submit(item)))
        assert await first == 0 and await asyncio.gather(*later) == list(range(1, 9))
        await batcher.close()

    asyncio.run(main())
    assert seen == [1, 8]


def test_micro_batcher_does_not_hold_a_lone_request_in_sparse_traffic() -> None:
    async def main() -> list[float]:
        batcher = MicroBatcher(lambda items: items, max_batch_size=8, batch_wait_timeout_s=0.2)
        waits = []
        for item in range(3):
            start = time.perf_counter()
            await batcher.submit(item)
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.25)  # arrivals further apart than the window
        await batcher.close()
        return waits

    assert max(asyncio.run(main())) < 0.1, "a lone request was held for the 0.2 s window"


def test_micro_batcher_fails_only_the_callers_whose_items_fail_alone() -> None:
    """A batch that fails is handled again one item at a time: the good items of a batch
    with a bad one are answered."""
    calls: list[list[int]] = []

    def handle(items: list[int]) -> list[int]:
        calls.append(items)
        if 3 in items:
            raise RuntimeError("bad image 3")
        return items

    async def main() -> list[Any]:
        batcher = MicroBatcher(handle, max_batch_size=2, batch_wait_timeout_s=0.05)
        results = await asyncio.gather(
            *(batcher.submit(i) for i in range(4)), return_exceptions=True
        )
        await batcher.close()
        return list(results)

    results = asyncio.run(main())
    assert results[:3] == [0, 1, 2]
    assert isinstance(results[3], RuntimeError) and "bad image 3" in str(results[3])
    assert calls == [[0, 1], [2, 3], [2], [3]]


def test_micro_batcher_refuses_a_wrong_number_of_results() -> None:
    async def main() -> None:
        batcher = MicroBatcher(
            lambda items: [*items, 0], max_batch_size=2, batch_wait_timeout_s=0.05
        )
        for outcome in await asyncio.gather(
            batcher.submit(1), batcher.submit(2), return_exceptions=True
        ):
            assert isinstance(outcome, ValueError)
            assert "returned 2 results for 1 items" in str(outcome)
        await batcher.close()

    asyncio.run(main())


def test_micro_batcher_checks_each_item_before_it_joins_a_batch() -> None:
    batched: list[list[int]] = []

    def check(item: int) -> int:
        if item < 0:
            raise RequestError(f"item {item} is negative")
        return item * 2

    def handle(items: list[int]) -> list[int]:
        batched.append(items)
        return items

    async def main() -> list[Any]:
        batcher = MicroBatcher(handle, max_batch_size=8, batch_wait_timeout_s=0.05, check=check)
        results = await asyncio.gather(
            *(batcher.submit(i) for i in (1, -1, 2)), return_exceptions=True
        )
        await batcher.close()
        return list(results)

    results = asyncio.run(main())
    assert results[0] == 2 and results[2] == 4
    assert isinstance(results[1], RequestError) and "item -1 is negative" in str(results[1])
    assert batched == [[2, 4]], "the bad item never joined the batch"


def test_micro_batcher_turns_requests_away_beyond_max_queued() -> None:
    def handle(items: list[int]) -> list[int]:
        time.sleep(0.1)
        return items

    async def main() -> list[Any]:
        batcher = MicroBatcher(handle, max_batch_size=4, batch_wait_timeout_s=0, max_queued=2)
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.02)  # the first is being handled: the others wait
        results = await asyncio.gather(
            *(batcher.submit(i) for i in range(1, 5)), return_exceptions=True
        )
        await first
        await batcher.close()
        return list(results)

    results = asyncio.run(main())
    assert results[:2] == [1, 2]
    assert all(isinstance(r, ServiceOverloaded) and "2 requests are waiting" in str(r)
               for r in results[2:])  # fmt: skip


def test_micro_batcher_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(lambda items: items, max_batch_size=0)
    with pytest.raises(ValueError, match="batch_wait_timeout_s"):
        MicroBatcher(lambda items: items, batch_wait_timeout_s=-1)
    with pytest.raises(ValueError, match="max_queued must be at least 1"):
        MicroBatcher(lambda items: items, max_queued=0)


def test_embed_batches_adds_embeddings_and_keeps_other_columns(build: Any) -> None:
    job = EmbedBatches(build, backend=SimulatedGraphs())
    images = np.random.rand(5, *SHAPE).astype(np.float32)
    out = job({"image": images, "id": np.arange(5)})
    assert out["id"].tolist() == list(range(5))
    assert out["embedding"].dtype == np.float32
    np.testing.assert_allclose(
        out["embedding"],
        eager(build, torch.from_numpy(images)).numpy(),
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )
    with pytest.raises(KeyError, match="no column 'pixels'"):
        EmbedBatches(build, column="pixels", backend=SimulatedGraphs())({"image": images})


BAD_IMAGES: list[tuple[Any, int, str]] = [
    (torch.randn(3, 64, 64), 422, "image size 64x64 differs from the encoder's 32x32"),
    (torch.randn(3, 32, 33), 422, "image size 32x33 differs"),
    (torch.randn(1, 32, 32), 422, "the image has 1 channels; the encoder takes 3"),
    (torch.randn(32, 32), 422, "expected one image of shape [channels, height, width]"),
    (torch.randn(1, 3, 32, 32), 422, "expected one image of shape"),
    (torch.empty(3, 0, 32), 422, "the image is empty"),
    (torch.full((3, 32, 32), float("nan")), 422, "NaN or infinite values"),
    (torch.full((3, 32, 32), float("inf")), 422, "NaN or infinite values"),
    (torch.randint(0, 255, (3, 32, 32)), 422, "images are torch.int64"),
    (torch.zeros(3, 32, 32, dtype=torch.bool), 422, "images are torch.bool"),
    (torch.zeros(3, 32, 32, dtype=torch.complex64), 422, "images are torch.complex64"),
    (np.array(["a"] * 4), 415, "a numeric image array"),
    ("garbage", 415, "expected an image tensor or array"),
    (torch.randn(3, 4096, 4096), 413, "more than the"),
]
"""Requests the encoder refuses: the item, the HTTP status, and words of the reason."""


@pytest.mark.parametrize("item, status, reason", BAD_IMAGES, ids=[r for _, _, r in BAD_IMAGES])
def test_a_bad_image_is_refused_by_name_with_its_status(
    build: Any, item: Any, status: int, reason: str
) -> None:
    encoder = ImageEncoder(
        build,
        backend=SimulatedGraphs(),
        image_shape=SHAPE,
        check=ImageCheck(shape=SHAPE, max_pixels=1024 * 1024),
    )
    with pytest.raises(RequestError) as refused:
        encoder.prepare(item)
    assert reason in str(refused.value) and refused.value.status == status
    assert refused.value.to_json() == {"error": {"status": status, "message": str(refused.value)}}
    with pytest.raises(RequestError, match="image 1: "):
        encoder([torch.randn(*SHAPE), item])
    assert encoder.report()["batch_sizes"] == {}, "nothing reached the model"


def test_eight_bit_images_are_scaled_where_the_service_says_so(build: Any) -> None:
    encoder = ImageEncoder(
        build, backend=SimulatedGraphs(), check=ImageCheck(shape=SHAPE, integer_images="scale")
    )
    pixels = torch.randint(0, 256, (2, *SHAPE), dtype=torch.uint8)
    want = eager(build, pixels.float() / 255)
    torch.testing.assert_close(encoder(pixels), want, rtol=TOLERANCE, atol=TOLERANCE)
    with pytest.raises(RequestError, match="scales uint8 pixels only"):
        encoder.prepare(pixels[0].to(torch.int32))
    with pytest.raises(ValueError, match="integer_images must be"):
        ImageCheck(integer_images="round")  # type: ignore[arg-type]


def test_bad_requests_mixed_into_concurrent_traffic_fail_alone(build: Any) -> None:
    """Good and bad requests sent together through a MicroBatcher fed by an encoder: every
    good one is answered with its own embedding, every bad one refused with its reason."""
    encoder = ImageEncoder(build, backend=SimulatedGraphs(), image_shape=SHAPE)
    generator = torch.Generator().manual_seed(5)
    good = [torch.randn(*SHAPE, generator=generator) for _ in range(20)]
    bad = [item for item, _, _ in BAD_IMAGES[:8]]
    requests = [*good[:10], *bad, *good[10:]]

    async def main() -> list[Any]:
        batcher = MicroBatcher(encoder.embed_prepared_list, max_batch_size=8, check=encoder.prepare)
        results = await asyncio.gather(
            *(batcher.submit(item) for item in requests), return_exceptions=True
        )
        await batcher.close()
        return list(results)

    results = asyncio.run(main())
    answers = [r for r in results if isinstance(r, torch.Tensor)]
    refusals = [r for r in results if isinstance(r, Exception)]
    assert len(answers) == len(good) and all(isinstance(r, RequestError) for r in refusals)
    torch.testing.assert_close(
        torch.stack(answers), eager(build, torch.stack(good)), rtol=TOLERANCE, atol=TOLERANCE
    )
    assert sum(encoder.report()["batch_sizes"].values()) < len(good), "batches formed"


def test_a_ray_data_batch_with_a_bad_row_names_it(build: Any) -> None:
    job = EmbedBatches(build, backend=SimulatedGraphs(), image_shape=SHAPE)
    images = np.random.rand(3, *SHAPE).astype(np.float32)
    images[2, 0, 0, 0] = np.nan
    with pytest.raises(RequestError, match="image 2: the image has NaN"):
        job({"image": images})
