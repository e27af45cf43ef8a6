"""The Ray Serve deployment under HTTP load on this machine (CPU, graphs simulated): latency
of one client's sequential requests, then ``--requests`` requests from ``--clients``
concurrent clients (``EmbeddingClient``), and the batch sizes one replica formed.

    python3 benchmarks/service_http_load.py [--replicas 2] [--clients 24] [--requests 600]

A timm ViT-S/16 at 64x64 pixels stands for the encoder; what is measured is the batching and
the HTTP path, not the model. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
import timm
import torch
from ray import serve

from layergraph.service.client import EmbeddingClient
from layergraph.service.ray import EncoderDeployment
from layergraph.testing import SimulatedGraphs

PORT = 8765


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    app = EncoderDeployment.options(num_replicas=args.replicas, max_ongoing_requests=64).bind(
        build,
        max_batch_size=32,
        batch_wait_timeout_s=args.batch_wait_ms / 1e3,
        backend=SimulatedGraphs(),
    )
    handle = serve.run(app, name="load", route_prefix="/embed")
    client = EmbeddingClient(f"http://127.0.0.1:{PORT}/embed")
    image = np.random.rand(3, 64, 64).astype(np.float32)

    def one(_: int) -> float:
        start = time.perf_counter()
        client.embed(image)
        return (time.perf_counter() - start) * 1e3

    sequential = [one(i) for i in range(40)]
    with ThreadPoolExecutor(args.clients) as pool:
        start = time.perf_counter()
        loaded = list(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - start
    reports = [handle.report.remote().result() for _ in range(4 * args.replicas)]
    busiest = max(reports, key=lambda report: sum(report["batch_sizes"].values()))
    print(
        json.dumps(
            {
                "sequential_p50_ms": statistics.median(sequential),
                "loaded_p50_ms": statistics.median(loaded),
                "loaded_p99_ms": float(np.percentile(loaded, 99)),
                "requests_per_s": args.requests / wall,
                "one_replica_batch_sizes": dict(sorted(busiest["batch_sizes"].items())),
            }
        )
    )
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
