"""layergraph.service without Ray: an ImageEncoder's embeddings against the model's own on fresh
random images (graphs simulated on the CPU, float32, so within 1e-5), graphs captured before
traffic and started from a warm-start file, the MicroBatcher's batches under concurrent
requests, and the Ray Data callable on numpy batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from layergraph.service import EmbedBatches, ImageEncoder, MicroBatcher
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


def test_micro_batcher_gives_a_failure_to_every_caller_of_its_batch() -> None:
    def handle(items: list[int]) -> list[int]:
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
    assert results[:2] == [0, 1]
    assert all(isinstance(r, RuntimeError) and "bad image 3" in str(r) for r in results[2:])


def test_micro_batcher_refuses_a_wrong_number_of_results() -> None:
    async def main() -> None:
        batcher = MicroBatcher(lambda items: items[:1], max_batch_size=2, batch_wait_timeout_s=0.05)
        with pytest.raises(ValueError, match="returned 1 results for 2 items"):
            await asyncio.gather(batcher.submit(1), batcher.submit(2))
        await batcher.close()

    asyncio.run(main())


def test_micro_batcher_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(lambda items: items, max_batch_size=0)
    with pytest.raises(ValueError, match="batch_wait_timeout_s"):
        MicroBatcher(lambda items: items, batch_wait_timeout_s=-1)


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
