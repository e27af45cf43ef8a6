"""One large batch of a tower whose activations fill most of the device, each way of running it
measured alone, with the memory of the others released.

    python3 benchmarks/large_batch.py --model timm:samvit_base_patch16 --batch 32 --compile \\
        --json sam32.json                                                   # a GPU
    python3 benchmarks/large_batch.py --tiny --json tiny.json               # the CPU

``layergraph bench`` holds layergraph's graphs while it times eager and the hand-written graph
beside them, so a batch whose forward needs more than half the device's memory cannot run
there. This times each column on its own (``--model``, an example model of
``layergraph bench --list``, random weights, ``--dtype``): **eager**, **layergraph**
(``layergraph.wrap`` with its defaults: the first call captures, or, where the capture runs out
of memory, the call runs eagerly and ``served`` says why), **hand-written** (the whole forward
captured by hand, :func:`layergraph.reference.plain_graph`, its output cloned as layergraph's
is) and, with ``--compile``, **torch.compile** (``mode="reduce-overhead"``). For each: the
median milliseconds of a call waited for (:func:`layergraph.timing.waited_ms`) and of calls in
a loop (:func:`layergraph.timing.median_ms`), the seconds of its first call (capture,
compile), the peak memory allocated, and its output's relative error against eager's on a
fresh batch; a column that runs out of memory is recorded as such and the next one runs.
``--tiny`` runs a small ViT in float32 on the CPU, eager and layergraph only (graphs simulated
by :class:`layergraph.testing.SimulatedGraphs`); its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils import _pytree as pytree

import layergraph
from layergraph.bench.examples import example_model
from layergraph.reference import compiled_reduce_overhead, plain_graph
from layergraph.testing import SimulatedGraphs
from layergraph.timing import median_ms, waited_ms
from layergraph.validation import first_tensor, relative_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def prepared(
    column: str,
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    capturable: Callable[[torch.nn.Module], AbstractContextManager[Any]] | None = None,
) -> tuple[Callable[..., Any], Any]:
    """The callable timed for ``column`` and the wrapper to read stats from (or ``None``);
    the hand-written graph captured inside the example's ``capturable`` where it has one."""
    cuda = args[0].device.type == "cuda"
    if column == "eager":
        return model, None
    if column == "layergraph":
        graphed = layergraph.wrap(model, **({} if cuda else {"backend": SimulatedGraphs()}))
        return graphed, graphed
    if column == "hand_written":
        with capturable(model) if capturable else contextlib.nullcontext():
            graph = plain_graph(model, *args, **kwargs)

        def cloned(*call_args: Any, **call_kwargs: Any) -> Any:
            return pytree.tree_map_only(torch.Tensor, torch.clone, graph(*call_args, **call_kwargs))

        return cloned, None
    return compiled_reduce_overhead(model), None


def measure(
    column: str,
    model: torch.nn.Module,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    fresh: tuple[tuple[Any, ...], dict[str, Any]],
    iters: int,
    capturable: Callable[[torch.nn.Module], AbstractContextManager[Any]] | None = None,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """``column`` alone: its row, and its output on ``fresh`` (on the CPU); the memory it
    held released after, and the model unwrapped. A column that runs out of memory gives a
    row saying so (and layergraph's, its stats)."""
    (args, kwargs), device = call, call[0][0].device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    row: dict[str, Any] = {"column": column}
    output = fn = graphed = None
    try:
        started = time.perf_counter()
        fn, graphed = prepared(column, model, args, kwargs, capturable)
        fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - started
        row["loop_ms"] = median_ms(
            lambda: fn(*args, **kwargs), device=device, warmup=2, iters=iters
        )
        row["waited_ms"] = waited_ms(
            lambda: fn(*args, **kwargs), device=device, warmup=2, iters=iters
        )
        output = first_tensor(fn(*fresh[0], **fresh[1])).float().cpu()
    except torch.OutOfMemoryError as error:
        row["out_of_memory"] = str(error).splitlines()[0]
    finally:
        if graphed is not None:
            stats = graphed.stats
            row["served"] = sorted({way for _, way in stats.served})
            row["eager_reasons"] = dict(stats.eager_calls)
            row["graphs"], row["pool_gib"] = stats.graphs, stats.pool_bytes / 2**30
            graphed.unwrap()
        fn = graphed = None
        gc.collect()
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch._dynamo.reset()
    return row, output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="timm:samvit_base_patch16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=10, help="calls timed per column and way")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--tiny", action="store_true", help="a small ViT in float32, the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = DTYPES[args.dtype]
    columns = ["eager", "layergraph"]
    if args.tiny:
        args.model, args.batch, args.iters, dtype = "timm:vit_tiny_patch16_224", 2, 3, torch.float32
    elif device.type == "cuda":
        columns += ["hand_written"] + (["compile"] if args.compile else [])
    example = example_model(args.model)
    torch.manual_seed(0)
    model = example.build(dtype, device)
    call, fresh = (
        example.inputs(args.batch, dtype, device),
        example.inputs(args.batch, dtype, device),
    )
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30
        if device.type == "cuda"
        else None,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "layergraph": layergraph.__version__,
        },
        "dtype": str(dtype).removeprefix("torch."),
        "settings": vars(args),
        "rows": [],
    }
    eager_output = None
    with torch.inference_mode():
        for column in columns:
            row, output = measure(column, model, call, fresh, args.iters, example.capturable)
            if column == "eager":
                eager_output = output
            elif output is not None and eager_output is not None:
                row["error_vs_eager"] = relative_error(output, eager_output)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
