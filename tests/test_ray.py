"""layergraph on a local Ray instance (CPU, graphs simulated): the Serve deployment's batched
embeddings through a handle and over HTTP, and a Ray Data job with EmbedBatches, each against
the model's own embeddings on fresh random images (float32, within 1e-5)."""

from __future__ import annotations

import io
import json
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
timm = pytest.importorskip("timm")

from ray import serve  # noqa: E402

from layergraph.service import EmbedBatches  # noqa: E402
from layergraph.service.ray import EncoderDeployment  # noqa: E402
from layergraph.testing import SimulatedGraphs  # noqa: E402

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
SHAPE = (3, 32, 32)


@pytest.fixture(scope="module")
def build(saved_vit_builder: Any) -> Any:
    return saved_vit_builder


def eager(build: Any, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return build().eval()(images)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[int]:
    """A local Ray instance on the CPU; yields Serve's HTTP port."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_deployment_batches_requests_and_answers_from_graphs(
    local_ray: int, build: Any
) -> None:
    app = EncoderDeployment.bind(
        build,
        max_batch_size=4,
        batch_wait_timeout_s=0.2,
        capture=[4],
        image_shape=SHAPE,
        backend=SimulatedGraphs(),
    )
    handle = serve.run(app, name="encoder", route_prefix="/embed")
    images = torch.randn(10, *SHAPE)
    answers = [handle.embed.remote(image) for image in images]
    got = torch.stack([answer.result() for answer in answers])
    torch.testing.assert_close(got, eager(build, images), rtol=TOLERANCE, atol=TOLERANCE)
    report = handle.report.remote().result()
    sizes = report["batch_sizes"]
    assert sum(size * count for size, count in sizes.items()) == 10
    assert max(sizes) > 1 and max(sizes) <= 4  # batched, never beyond max_batch_size
    assert report["replays"] == sum(sizes.values()) and report["eager_calls"] == {}

    image = torch.randn(*SHAPE)
    body = io.BytesIO()
    np.save(body, image.numpy())
    request = urllib.request.Request(
        f"http://127.0.0.1:{local_ray}/embed", data=body.getvalue(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        embedding = torch.tensor(json.loads(response.read())["embedding"])
    torch.testing.assert_close(
        embedding, eager(build, image[None])[0], rtol=TOLERANCE, atol=TOLERANCE
    )
    serve.delete("encoder")


def test_a_ray_data_job_embeds_every_row(local_ray: int, build: Any) -> None:
    images = np.random.rand(13, *SHAPE).astype(np.float32)
    dataset = ray.data.from_items([{"id": i, "image": image} for i, image in enumerate(images)])
    embedded = dataset.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"build": build, "backend": SimulatedGraphs()},
        batch_size=5,
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    rows = sorted(embedded.take_all(), key=lambda row: row["id"])
    assert [row["id"] for row in rows] == list(range(13))
    got = torch.from_numpy(np.stack([row["embedding"] for row in rows]))
    torch.testing.assert_close(
        got, eager(build, torch.from_numpy(images)), rtol=TOLERANCE, atol=TOLERANCE
    )
