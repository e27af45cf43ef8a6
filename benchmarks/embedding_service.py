"""An image-embedding service under concurrent clients, eager against layergraph, on one GPU;
and sentence-transformers' ``encode`` of images, eager against wrapped.

    python3 benchmarks/embedding_service.py --json results.json [--models ViT-B-32 ViT-L-14]
        [--clients 4 16 64] [--seconds 6] [--sentence-transformers clip-ViT-B-32 ...]

The service is what :class:`layergraph.service.ray.EncoderDeployment` runs in each replica, called
directly (Ray is not needed): an :class:`~layergraph.service.ImageEncoder` whose
``embed_list`` is fed by dynamic batching (:class:`~layergraph.service.MicroBatcher`: a batch
forms when the encoder is free and closes when it holds ``--max-batch-size`` requests or
``--batch-wait-ms`` after its first). Each client sends one image (a float32 CPU tensor), waits
for its embedding and sends the next. Eager is the same encoder with ``graphed=False``; the
wrapped one uses ``layergraph.wrap``'s defaults (the measured shape policy decides how each
batch size runs). After a warm-up round for each, they take turns for ``--rounds`` rounds of
``--seconds``; reported: requests per second, p50/p99 latency of a request (from submit to
its embedding) over all rounds, and the batch sizes formed.

The sentence-transformers rows time ``model.encode(images, batch_size=N)`` on PIL images, the
model's own preprocessing included, for a random CLIP of the checkpoint's shape saved locally
(:mod:`embedding_models`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import layergraph
from layergraph.service import ImageEncoder, MicroBatcher
from layergraph.timing import waited_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding_models import (
    SENTENCE_TRANSFORMERS_CLIPS,
    image_size,
    open_clip_model,
    save_clip,
)


async def drive(
    encoder: ImageEncoder,
    images: list[torch.Tensor],
    *,
    clients: int,
    seconds: float,
    max_batch_size: int,
    batch_wait_s: float,
) -> tuple[list[float], float, dict[int, int]]:
    """Closed-loop clients for ``seconds``: each request's latency (ms), the time taken (s)
    and the batch sizes formed."""
    batcher = MicroBatcher(
        encoder.embed_list, max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_s
    )
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds

    async def client(index: int) -> None:
        while loop.time() < stop:
            started = time.perf_counter()
            await batcher.submit(images[index % len(images)])
            latencies.append((time.perf_counter() - started) * 1e3)
            index += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    await batcher.close()
    return latencies, elapsed, dict(batcher.batch_sizes)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def serve(name: str, clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """One model under ``clients`` clients: eager and layergraph in turns."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    build = functools.partial(open_clip_model, name, dtype, args.device)
    encoders = {"eager": ImageEncoder(build, graphed=False), "layergraph": ImageEncoder(build)}
    size = image_size(encoders["eager"].model)
    images = [torch.randn(3, *size) for _ in range(64)]
    settings = dict(
        clients=clients,
        max_batch_size=args.max_batch_size,
        batch_wait_s=args.batch_wait_ms / 1e3,
    )
    results: dict[str, Any] = {}
    for method, encoder in encoders.items():  # warm-up: first sight of each batch size
        asyncio.run(drive(encoder, images, seconds=args.seconds, **settings))
        results[method] = {"latencies": [], "seconds": 0.0, "batch_sizes": {}}
    for round_ in range(args.rounds):
        order = list(encoders) if round_ % 2 == 0 else list(reversed(encoders))
        for method in order:
            latencies, elapsed, sizes = asyncio.run(
                drive(encoders[method], images, seconds=args.seconds, **settings)
            )
            result = results[method]
            result["latencies"] += latencies
            result["seconds"] += elapsed
            for batch, count in sizes.items():
                result["batch_sizes"][batch] = result["batch_sizes"].get(batch, 0) + count
    check = torch.stack(images[:8])
    want, got = encoders["eager"](check), encoders["layergraph"](check)
    row: dict[str, Any] = {
        "model": name,
        "clients": clients,
        "image_size": size[0],
        "relative_error_vs_eager": float((got - want).norm() / want.norm()),
    }
    for method, result in results.items():
        latencies = result["latencies"]
        row[method] = {
            "requests": len(latencies),
            "images_per_s": len(latencies) / result["seconds"],
            "p50_ms": statistics.median(latencies),
            "p99_ms": percentile(latencies, 99),
            "batch_sizes": dict(sorted(result["batch_sizes"].items())),
        }
    graphed = encoders["layergraph"].graphed
    assert graphed is not None
    row["layergraph"]["graphs"] = graphed.stats.graphs
    row["layergraph"]["served"] = sorted({way for (_, way) in graphed.stats.served})
    row["throughput_vs_eager"] = row["layergraph"]["images_per_s"] / row["eager"]["images_per_s"]
    row["p99_vs_eager"] = row["layergraph"]["p99_ms"] / row["eager"]["p99_ms"]
    print(
        f"{name:12} {clients:3} clients: eager {row['eager']['images_per_s']:8.1f}/s "
        f"p50 {row['eager']['p50_ms']:7.2f} p99 {row['eager']['p99_ms']:7.2f} | layergraph "
        f"{row['layergraph']['images_per_s']:8.1f}/s p50 {row['layergraph']['p50_ms']:7.2f} "
        f"p99 {row['layergraph']['p99_ms']:7.2f} | {row['throughput_vs_eager']:.2f}x, "
        f"p99 {row['p99_vs_eager']:.2f}x",
        flush=True,
    )
    for encoder in encoders.values():
        if encoder.graphed is not None:
            encoder.graphed.unwrap()
    return row


def sentence_transformer_rows(
    name: str, batches: list[int], iters: int, device: str
) -> list[dict[str, Any]]:
    """``encode`` of PIL images by a sentence-transformers CLIP of ``name``'s shape."""
    import numpy as np
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as folder:
        save_clip(Path(folder), SENTENCE_TRANSFORMERS_CLIPS[name])
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = SentenceTransformer(folder, device=device, model_kwargs={"dtype": dtype})
    rows = []
    photos = [
        Image.fromarray((np.random.rand(256, 320, 3) * 255).astype("uint8")) for _ in range(64)
    ]
    graphed = layergraph.wrap(model)
    for batch in batches:
        images = photos[:batch]

        def encode(images: list[Any] = images, batch: int = batch) -> torch.Tensor:
            return model.encode(images, batch_size=batch, convert_to_tensor=True)

        with graphed.original():
            want = encode().float()
            eager = waited_ms(encode, device=model.device, warmup=3, iters=iters)
        got = encode().float()
        wrapped = waited_ms(encode, device=model.device, warmup=3, iters=iters)
        row = {
            "model": f"sentence-transformers {name}",
            "batch": batch,
            "eager_ms": eager,
            "layergraph_ms": wrapped,
            "speedup_vs_eager": eager / wrapped,
            "relative_error_vs_eager": float((got - want).norm() / want.norm()),
            "served": sorted({way for (_, way) in graphed.stats.served}),
        }
        rows.append(row)
        print(
            f"{row['model']} b{batch}: eager {eager:.2f} ms, layergraph {wrapped:.2f} ms "
            f"({row['speedup_vs_eager']:.2f}x), error {row['relative_error_vs_eager']:.1e}",
            flush=True,
        )
    graphed.unwrap()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["ViT-B-32", "ViT-L-14"])
    parser.add_argument("--clients", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--sentence-transformers", nargs="*", default=list(SENTENCE_TRANSFORMERS_CLIPS)
    )
    parser.add_argument("--st-batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (eager only)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    record: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "layergraph": layergraph.__version__,
        "command": " ".join(["python3", "benchmarks/embedding_service.py", *sys.argv[1:]]),
        "settings": {
            "max_batch_size": args.max_batch_size,
            "batch_wait_ms": args.batch_wait_ms,
            "seconds": args.seconds,
            "rounds": args.rounds,
        },
        "service": [],
        "sentence_transformers": [],
    }
    for name in args.models:
        for clients in args.clients:
            record["service"].append(serve(name, clients, args))
            torch.cuda.empty_cache()
    for name in args.sentence_transformers:
        record["sentence_transformers"] += sentence_transformer_rows(
            name, args.st_batch_sizes, args.iters, args.device
        )
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
