"""open_clip image towers on one GPU: eager, a hand-written CUDA graph, torch.compile and
layergraph, side by side.

    python3 benchmarks/open_clip_towers.py --json results.json [--models ViT-L-14 ...]
        [--batch-sizes 1 8 32] [--compile ViT-B-32 ViT-L-14]

Each model is open_clip's architecture with random weights in bf16
(:mod:`embedding_models`). For each batch size ``model.encode_image`` is timed: the model as it
is (eager); its tower captured by hand with ``torch.cuda.graph`` (the unmodified layers);
``torch.compile(mode="reduce-overhead")`` of the tower for the models named by ``--compile``;
and a copy wrapped with ``layergraph.wrap(model)`` and its defaults (the speed options left to
``"auto"``). Two timings per method, CUDA events: waited (each call's result waited for, the
methods taking turns: :func:`layergraph.timing.interleaved_waited_ms`) and loop (back-to-back
calls, the host's work hidden: :func:`layergraph.timing.median_ms`). Errors are relative to a
float32 copy of the model's ``encode_image`` on the same images.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

import layergraph
from layergraph.reference import compiled_reduce_overhead, plain_graph
from layergraph.timing import interleaved_waited_ms, median_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding_models import OPEN_CLIP_MODELS, image_size, open_clip_model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def measure(name: str, batches: list[int], compile_: bool, iters: int) -> list[dict[str, Any]]:
    """Rows of one model, one per batch size."""
    model = open_clip_model(name, torch.bfloat16, "cuda")
    reference = copy.deepcopy(model).float()
    wrapped = copy.deepcopy(model)
    graphed = layergraph.wrap(wrapped)
    compiled = compiled_reduce_overhead(model.visual) if compile_ else None
    rows = []
    with torch.inference_mode():
        for batch in batches:
            x = torch.randn(batch, 3, *image_size(model), device="cuda", dtype=torch.bfloat16)
            graphed.capture(x, batch_sizes=[batch], progress=False)
            row = measure_batch(model, wrapped, reference, compiled, x, iters)
            row.update(
                model=name,
                speed_options=dict(graphed.speed_options),
                served=sorted({way for (_, way) in graphed.stats.served}),
            )
            rows.append(row)
            waited = row["waited_ms"]
            print(
                f"{name:26} b{batch:<3} eager {waited['eager']:8.3f}  hand "
                f"{waited['hand_graph']:8.3f}  layergraph {waited['layergraph']:8.3f} ms  "
                f"{row['speedup_vs_eager']:.2f}x eager, {row['vs_hand_graph']:.3f}x hand "
                f"(loop {row['loop_speedup_vs_eager']:.2f}x, {row['loop_vs_hand_graph']:.3f}x)"
                + (f"  compiled {waited['compiled']:.3f}" if "compiled" in waited else ""),
                flush=True,
            )
    graphed.unwrap()
    return rows


def measure_batch(
    model: torch.nn.Module,
    wrapped: torch.nn.Module,
    reference: torch.nn.Module,
    compiled: Any,
    x: torch.Tensor,
    iters: int,
) -> dict[str, Any]:
    """One batch of images ``x`` through every method: times, ratios and errors."""
    by_hand = plain_graph(model.visual, x)
    methods = {
        "eager": lambda: model.encode_image(x),
        "hand_graph": lambda: by_hand(x),
        "layergraph": lambda: wrapped.encode_image(x),
    }
    if compiled is not None:
        for _ in range(3):
            compiled(x)
        methods["compiled"] = lambda: compiled(x)
    want = reference.encode_image(x.float())
    waited = interleaved_waited_ms(methods, device=x.device, iters=iters)
    loop = {
        method: median_ms(fn, device=x.device, iters=iters * 3) for method, fn in methods.items()
    }
    return {
        "batch": x.shape[0],
        "image_size": x.shape[-1],
        "waited_ms": waited,
        "loop_ms": loop,
        "speedup_vs_eager": waited["eager"] / waited["layergraph"],
        "vs_hand_graph": waited["layergraph"] / waited["hand_graph"],
        "loop_speedup_vs_eager": loop["eager"] / loop["layergraph"],
        "loop_vs_hand_graph": loop["layergraph"] / loop["hand_graph"],
        "error_vs_float32": {
            "eager": relative_error(model.encode_image(x), want),
            "layergraph": relative_error(wrapped.encode_image(x), want),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(OPEN_CLIP_MODELS))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--compile", nargs="*", default=["ViT-B-32", "ViT-L-14"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import open_clip

    rows = []
    for name in args.models:
        rows += measure(name, args.batch_sizes, name in args.compile, args.iters)
        torch.cuda.empty_cache()
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
        "layergraph": layergraph.__version__,
        "command": " ".join(["python3", "benchmarks/open_clip_towers.py", *sys.argv[1:]]),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
