"""layergraph on a local Ray instance (CPU, graphs simulated): the Serve deployment's batched
embeddings through a handle and over HTTP, and a Ray Data job with EmbedBatches, each against
the model's own embeddings on fresh random images (float32, within 1e-5)."""

from __future__ import annotations

import io
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
timm = pytest.importorskip("timm")

from ray import serve  # noqa: E402

from layergraph.service import EmbedBatches, RequestError, default_embed  # noqa: E402
from layergraph.service.client import EmbeddingClient, ServiceUnavailable  # noqa: E402
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


def post(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of an HTTP POST of ``body`` to the deployment."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/embed", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def npy(array: np.ndarray) -> bytes:
    body = io.BytesIO()
    np.save(body, array)
    return body.getvalue()


def test_bad_requests_fail_alone_with_errors_a_client_can_read(local_ray: int, build: Any) -> None:
    """Bad requests sent with good ones, through a handle and over HTTP: every good one is
    answered with its own embedding; every bad one fails with its reason (a 4xx and a strict
    JSON body over HTTP), never a good one."""
    app = EncoderDeployment.bind(
        build,
        max_batch_size=8,
        batch_wait_timeout_s=0.2,
        image_shape=SHAPE,
        max_body_bytes=2**20,
        backend=SimulatedGraphs(),
    )
    handle = serve.run(app, name="checked", route_prefix="/embed")
    good = torch.randn(12, *SHAPE)
    bad = [torch.randn(3, 64, 64), torch.full(SHAPE, float("nan")), torch.ones(*SHAPE).int()]
    answers = [handle.embed.remote(image) for image in [*good[:6], *bad, *good[6:]]]
    outcomes = []
    for answer in answers:
        try:
            outcomes.append(answer.result())
        except RequestError as error:
            outcomes.append(error)
    got = [o for o in outcomes if isinstance(o, torch.Tensor)]
    refused = [o for o in outcomes if isinstance(o, RequestError)]
    assert len(got) == len(good) and len(refused) == len(bad)
    torch.testing.assert_close(torch.stack(got), eager(build, good), rtol=TOLERANCE, atol=TOLERANCE)
    assert "differs from the encoder's 32x32" in str(refused[0]) and refused[0].status == 422

    cases = [
        (npy(np.zeros((3, 64, 64), np.float32)), 422, "image size 64x64"),
        (npy(np.full(SHAPE, np.nan, np.float32)), 422, "NaN or infinite"),
        (npy(np.zeros(SHAPE, np.int64)), 422, "images are torch.int64"),
        (npy(np.zeros(SHAPE, np.complex64)), 422, "torch.complex64"),
        (b"", 400, "no body"),
        (b"not an array", 400, "not a .npy array"),
        (npy(np.zeros((3, 400, 400), np.float32)), 413, "more than the"),
    ]
    for body, status, reason in cases:
        code, answer = post(local_ray, body)
        assert code == status and reason in answer["error"]["message"], (code, answer)
    code, answer = post(local_ray, npy(good[0].numpy()))
    assert code == 200
    torch.testing.assert_close(
        torch.tensor(answer["embedding"]), eager(build, good[:1])[0], rtol=TOLERANCE, atol=TOLERANCE
    )
    serve.delete("checked")


def test_load_with_bad_requests_and_a_replica_killed(local_ray: int, build: Any) -> None:
    """Concurrent clients through the retrying client, bad requests mixed in, one of two
    replicas killed while requests are in flight: every good request is answered with its
    own embedding or fails as retryable (never with a client error), every bad one gets a 4xx
    with its reason, and batches of several images form."""
    app = EncoderDeployment.options(num_replicas=2).bind(
        build, max_batch_size=8, batch_wait_timeout_s=0.01, image_shape=SHAPE,
        backend=SimulatedGraphs(),
    )  # fmt: skip
    handle = serve.run(app, name="loaded", route_prefix="/embed")
    client = EmbeddingClient(f"http://127.0.0.1:{local_ray}/embed", retries=2, backoff_s=0.5)
    generator = torch.Generator().manual_seed(7)
    good = torch.randn(160, *SHAPE, generator=generator)
    bad = [np.zeros((3, 16, 16), np.float32), np.full(SHAPE, np.inf, np.float32)] * 6
    requests: list[Any] = [image.numpy() for image in good]
    for index, item in enumerate(bad):
        requests.insert(index * 13 + 5, item)
    replicas = [
        name
        for name in ray.util.list_named_actors(all_namespaces=True)
        if "SERVE_REPLICA" in str(name) and "loaded" in str(name)
    ]
    assert len(replicas) == 2

    def send(item: Any) -> Any:
        try:
            return client.embed(item)
        except (RequestError, ServiceUnavailable) as error:
            return error

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(send, item) for item in requests]
        for _ in as_completed(futures[:40], timeout=120):
            pass  # a third of the traffic answered: the rest queued or in flight
        victim = replicas[0]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        outcomes = [future.result(timeout=120) for future in futures]

    want = eager(build, good)
    answered = 0
    for item, outcome in zip(requests, outcomes, strict=True):
        is_bad = any(item is b for b in bad)
        if is_bad:
            assert isinstance(outcome, RequestError) and 400 <= outcome.status < 500, outcome
            continue
        assert not isinstance(outcome, RequestError), outcome  # a good request never fails as bad
        if isinstance(outcome, ServiceUnavailable):
            continue  # retryable: the replica died with it in flight, on every try
        row = next(i for i, image in enumerate(requests) if image is item)
        index = row - sum(1 for b_item in requests[:row] if any(b_item is b for b in bad))
        torch.testing.assert_close(
            torch.tensor(outcome), want[index], rtol=TOLERANCE, atol=TOLERANCE
        )
        answered += 1
    assert answered >= len(good) - 2, f"{len(good) - answered} good requests failed"
    sizes = handle.report.remote().result()["batch_sizes"]
    assert max(sizes) > 1, f"no batch of several images formed: {sizes}"
    serve.delete("loaded")


def slow_embed(model: torch.nn.Module, images: Any) -> torch.Tensor:
    """The default embedding after 0.6 s: an encoder busy long enough for requests to queue."""
    time.sleep(0.6)
    return default_embed(model, images)


def test_a_batch_takes_the_requests_that_arrived_while_one_was_embedded(
    local_ray: int, build: Any
) -> None:
    """Requests that arrive while the encoder is busy, further apart than the window, form
    one batch (Ray Serve's ``@serve.batch`` would close a batch of one after each)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # slow_embed, by value
    app = EncoderDeployment.bind(
        build,
        max_batch_size=16,
        batch_wait_timeout_s=0.005,
        embed=slow_embed,
        backend=SimulatedGraphs(),
    )
    handle = serve.run(app, name="busy", route_prefix="/busy")
    images = torch.randn(7, *SHAPE)
    answers = [handle.embed.remote(images[0])]
    time.sleep(0.1)  # the first image's batch is being embedded
    for image in images[1:]:
        answers.append(handle.embed.remote(image))
        time.sleep(0.02)  # four windows apart
    got = torch.stack([answer.result() for answer in answers])
    torch.testing.assert_close(got, eager(build, images), rtol=TOLERANCE, atol=TOLERANCE)
    assert handle.report.remote().result()["batch_sizes"] == {1: 1, 6: 1}
    serve.delete("busy")


def test_an_overloaded_replica_answers_503_with_retry_after(local_ray: int, build: Any) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # slow_embed, by value
    app = EncoderDeployment.bind(
        build, max_batch_size=1, max_queued=1, embed=slow_embed, backend=SimulatedGraphs()
    )
    serve.run(app, name="full", route_prefix="/full")
    body = npy(np.random.rand(*SHAPE).astype(np.float32))
    url = f"http://127.0.0.1:{local_ray}/full"

    def raw(_: int) -> tuple[int, str | None, dict[str, Any]]:
        request = urllib.request.Request(url, data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, None, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After"), json.loads(error.read())

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(raw, range(6)))
    turned_away = [answer for answer in answers if answer[0] == 503]
    assert turned_away and all(code in (200, 503) for code, _, _ in answers), answers
    assert all(after == "1" and "requests are waiting" in body["error"]["message"]
               for _, after, body in turned_away)  # fmt: skip
    client = EmbeddingClient(url, retries=8, backoff_s=0.1)
    with ThreadPoolExecutor(max_workers=3) as pool:
        embedded = list(
            pool.map(lambda _: client.embed(np.random.rand(*SHAPE).astype(np.float32)), range(3))
        )
    assert len(embedded) == 3 and client.retried > 0, "the client retried the 503s"
    serve.delete("full")
