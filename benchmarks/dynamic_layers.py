"""Compiled layers with dynamic shapes against compiled layers per shape, on one GPU, with each
graph's FLOPs and the rate its replay ran at.

    python3 benchmarks/dynamic_layers.py --models siglip-so400m-384,whisper-large-v3-encoder \
        --batch-sizes 1,8,32 [--json results.json]

Each example model (``layergraph bench --list-models`` names) is built once in bfloat16 with
random weights, and a float32 copy is the reference. Four wrappers of copies capture every
batch size ahead, largest first, each timed from ``wrap`` to its last capture with Dynamo's
compiled graphs counted: the graphs as the adapter builds them (``compile_layers=False``),
``wrap``'s defaults (``compile_layers="auto"``: each key keeps the faster of the graph as built
and with compiled layers, ``stats.fusion``), ``compile_layers=True`` (dynamic shapes: one
compiled version for every size) and ``compile_layers={"dynamic": False}`` (one per size).
Then per batch size the eager model and the three are timed in turns, each call waited for
(:func:`layergraph.timing.interleaved_waited_ms`), with their errors against float32; each
row has the graph's FLOPs (``stats.flops``), the rate of the waited median and its share of
the card's measured bf16 matrix-product rate (:func:`layergraph.timing.matmul_peak_tflops`).
A wrapper whose options the model refuses (compiled layers of a convnet, which names no
layers) is left out with the reason. ``--device cpu`` with ``dinov2-small`` is a smoke run
(its calls run eagerly). What this does
not do: torch.compile of the whole model, streams, warm starts.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from pathlib import Path
from typing import Any

import torch

import layergraph
from layergraph.bench.examples import example_model
from layergraph.timing import interleaved_waited_ms, matmul_peak_tflops
from layergraph.validation import relative_error

WRAPPERS: dict[str, dict[str, Any]] = {
    "as_built": {"compile_layers": False},
    "default": {},
    "layers_dynamic": {"compile_layers": True},
    "layers_per_shape": {"compile_layers": {"dynamic": False}},
}
"""The ``wrap`` options of each wrapper timed."""


def first(output: Any) -> torch.Tensor:
    """The first tensor of an output: a tensor, a tuple's first, an output object's first."""
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, (tuple, list)) else output.to_tuple()[0]


def captured(
    model: torch.nn.Module, options: dict[str, Any], example: Any, batches: list[int]
) -> tuple[Any, dict[str, Any]]:
    """``model`` wrapped with ``options`` and every batch size captured ahead; the wrapper and
    what its start cost (seconds from ``wrap`` to the last capture, compiled graphs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    started = time.perf_counter()
    graphed = layergraph.wrap(model, batch_sizes=batches, **options)
    args, kwargs = example.inputs(max(batches), torch.bfloat16, model_device(model))
    if torch.cuda.is_available():  # elsewhere every call runs eagerly
        with torch.inference_mode():
            graphed.capture(*args, **kwargs, progress=False)
        torch.cuda.synchronize()
    return graphed, {
        "start_s": time.perf_counter() - started,
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "compile_s": graphed.compile_budget.spent,
        "graphs": graphed.stats.graphs,
    }


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def rows_of(name: str, batches: list[int], device: torch.device) -> dict[str, Any]:
    """One model's starts and rows, one row per batch size."""
    example = example_model(name)
    model = example.build(torch.bfloat16, device)
    reference = copy.deepcopy(model).float()
    wrappers, starts = {}, {}
    for label, options in WRAPPERS.items():
        try:
            wrappers[label], starts[label] = captured(
                copy.deepcopy(model), options, example, batches
            )
        except ValueError as refused:  # compiled layers of a model captured whole
            starts[label] = {"refused": str(refused)}
        print(name, label, starts[label], flush=True)
    peak = matmul_peak_tflops(device) if device.type == "cuda" else None
    rows = []
    for batch in batches:
        args, kwargs = example.inputs(batch, torch.bfloat16, device)
        wide = tuple(a.float() if a.is_floating_point() else a for a in args)
        wide_kwargs = {
            name: value.float() if torch.is_tensor(value) and value.is_floating_point() else value
            for name, value in kwargs.items()
        }
        calls = {"eager": functools.partial(model, *args, **kwargs)}
        calls.update(
            (label, functools.partial(graphed, *args, **kwargs))
            for label, graphed in wrappers.items()
        )
        with torch.inference_mode():
            want = first(reference(*wide, **wide_kwargs)).float()
            errors = {
                label: relative_error(first(fn()).float(), want) for label, fn in calls.items()
            }
            ms = interleaved_waited_ms(calls, device=device)
        flops = {label: graphed.stats.flops.get(batch) for label, graphed in wrappers.items()}
        counted = next((f for f in flops.values() if f), None)
        rates = {
            label: counted / milliseconds / 1e9 if counted else None
            for label, milliseconds in ms.items()
        }
        row = {
            "batch": batch,
            "ms": ms,
            "error_vs_float32": errors,
            "flops": flops,
            "tflops": rates,
            "share_of_matmul_peak": {
                label: rate / peak if rate and peak else None for label, rate in rates.items()
            },
            "fusion": {
                label: {size: str(choice) for size, choice in g.stats.fusion.items()}
                for label, g in wrappers.items()
            },
            "served": {
                label: {f"{size} {way}": n for (size, way), n in g.stats.served.items()}
                for label, g in wrappers.items()
            },
        }
        rows.append(row)
        print(name, json.dumps({k: row[k] for k in ("batch", "ms", "tflops")}), flush=True)
    return {"model": name, "starts": starts, "matmul_peak_tflops": peak, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="siglip-so400m-384")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    for name in args.models.split(","):
        results.append(rows_of(name, batches, device))
        if args.json:
            versions = {"torch": torch.__version__, "layergraph": layergraph.__version__}
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            record = {"gpu": gpu, "versions": versions, "results": results}
            args.json.write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
