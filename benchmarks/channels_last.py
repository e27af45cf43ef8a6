"""timm convnets in graphs with their convolutions in the channels-last layout, beside the
layout they are built in and ``torch.compile(mode="reduce-overhead")``.

    python3 benchmarks/channels_last.py --compile --json channels-last.json   # a GPU
    python3 benchmarks/channels_last.py --tiny --json tiny.json               # the CPU

cuDNN's tensor-core convolutions work in the channels-last (NHWC) layout; a model built by timm
holds its weights channels-first (NCHW), so each convolution of a graph replays layout
conversions around its kernel, which Inductor's code does not have. This measures what a user
gets by converting the model first (``model.to(memory_format=torch.channels_last)``, images
given as they come) and wrapping it: for each model (``--models``, random weights, bf16 by
``--dtype``) and batch size (``--batch-sizes``), the waited median milliseconds of a call
(:func:`layergraph.timing.interleaved_waited_ms`, the columns in turns) of

- **eager** and **eager, channels-last**: the model's forward, as built and converted;
- **hand-written** and **hand-written, channels-last**: the whole forward captured by hand
  (:func:`layergraph.reference.plain_graph`), the converted one on channels-last images;
- **layergraph** and **layergraph, channels-last**: ``layergraph.wrap`` of each;
- **torch.compile** (``--compile``): of the model as built.

Errors: each column's largest relative error against a float32 copy of the model as built.
``--tiny`` runs ResNet-18 at 64x64 in float32 on the CPU, eager and layergraph only (graphs
simulated by :class:`layergraph.testing.SimulatedGraphs`); its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import timm
import torch

import layergraph
from layergraph.reference import compiled_reduce_overhead, plain_graph
from layergraph.testing import SimulatedGraphs
from layergraph.timing import interleaved_waited_ms
from layergraph.validation import relative_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHANNELS_LAST = torch.channels_last


def columns(
    model: torch.nn.Module, images: torch.Tensor, compile_too: bool
) -> dict[str, Callable[[torch.Tensor], Any]]:
    """The callables timed, by column name, each taking a batch of channels-first images."""
    converted = copy.deepcopy(model).to(memory_format=CHANNELS_LAST)
    cuda = images.device.type == "cuda"
    backend = {} if cuda else {"backend": SimulatedGraphs()}
    fns: dict[str, Callable[[torch.Tensor], Any]] = {
        "eager": model,
        "eager_channels_last": converted,
        "layergraph": layergraph.wrap(copy.deepcopy(model), **backend),
        "layergraph_channels_last": layergraph.wrap(copy.deepcopy(converted), **backend),
    }
    if cuda:
        fns["hand_written"] = plain_graph(model, images)
        fns["hand_written_channels_last"] = plain_graph(
            converted, images.contiguous(memory_format=CHANNELS_LAST)
        )
        if compile_too:
            fns["compile"] = compiled_reduce_overhead(model)
    return fns


def measure(
    name: str, model: torch.nn.Module, reference: torch.nn.Module, args: argparse.Namespace
) -> list[dict[str, Any]]:
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    rows = []
    for batch in (int(size) for size in args.batch_sizes.split(",")):
        torch.manual_seed(batch)
        shape = (batch, 3, args.image_size, args.image_size)
        images = torch.randn(shape, device=device, dtype=dtype)
        fresh = torch.randn(shape, device=device, dtype=dtype)
        with torch.inference_mode():
            want = reference(fresh.float())
            started = time.perf_counter()
            fns = columns(model, images, args.compile)
            for fn in fns.values():  # captures, compiles
                fn(images)
            prepared_s = time.perf_counter() - started
            times = interleaved_waited_ms(
                {column: functools.partial(fn, images) for column, fn in fns.items()},
                device=device,
                rounds=args.rounds,
                iters=args.iters,
            )
            errors = {column: relative_error(fn(fresh).float(), want) for column, fn in fns.items()}
        graphed = [fns["layergraph"], fns["layergraph_channels_last"]]
        rows.append(
            {
                "model": name,
                "batch": batch,
                "waited_ms": times,
                "errors": errors,
                "prepared_s": prepared_s,
                "graphs": [g.stats.graphs for g in graphed],
                "eager_calls": [dict(g.stats.eager_calls) for g in graphed],
            }
        )
        line = "  ".join(f"{column} {ms:.3f}" for column, ms in times.items())
        print(f"{name} batch {batch}: waited ms  {line}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--models", default="resnet50,convnext_base,efficientvit_b2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of calls in turns")
    parser.add_argument("--iters", type=int, default=20, help="calls per column a round")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--tiny", action="store_true", help="ResNet-18, 64x64, the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = DTYPES[args.dtype]
    if args.tiny:
        args.models, args.image_size, args.rounds, args.iters = "resnet18", 64, 2, 2
        dtype, args.compile = torch.float32, False
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "timm": timm.__version__,
        },
        "dtype": str(dtype).removeprefix("torch."),
        "settings": vars(args),
        "rows": [],
    }
    for name in args.models.split(","):
        torch.manual_seed(0)
        built = timm.create_model(name, pretrained=False).eval()
        reference = copy.deepcopy(built).float().to(device)
        result["rows"] += measure(name, built.to(device, dtype), reference, args)
        torch._dynamo.reset()
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
