"""timm's NaFlexVit on batches of images of mixed sizes: eager, layergraph, a hand-written graph
and ``torch.compile(mode="reduce-overhead")``.

    python3 benchmarks/naflex_mixed.py --compile --json naflex.json   # a GPU: a few minutes
    python3 benchmarks/naflex_mixed.py --tiny --json tiny.json        # a tiny model, the CPU
    python3 benchmarks/naflex_mixed.py --options fuse_gelu=false --json naflex-options.json

The model is ``naflexvit_base_patch16_gap`` (ViT-B/16, NaFlex position embeddings, average
pooling) with random weights, bf16 (``--dtype``); nothing is downloaded. A call is a NaFlex batch
as timm's collator pads it: each image, of a seeded aspect ratio between 1:2 and 2:1 and a seeded
size, given the largest patch grid of that ratio within ``--patches`` patches, every row padded to
``--patches`` (patches, their (y, x) coordinates, which are real). For each batch size (``--batch-
sizes``), ``--calls`` such batches, all of other image sizes, run in turns:

- **eager**: the model's forward on the batch dict;
- **layergraph**: ``layergraph.wrap(model)`` (the timm adapter; ``--options`` gives it wrap
  options, and the speed options it took are reported): the patch and position embeddings
  eagerly (they read each image's grid on the host), then a graph of the blocks, norm and head
  per (rows, patches a row); its first pass captures (the seconds reported) and is not timed;
- **hand-written**: the same split written by hand: the model's ``_forward_embeds`` eagerly, its
  tokens, mask and validity copied into the static inputs of a ``torch.cuda.graph`` of the
  blocks, norm and head (one per batch size), replayed, the output cloned;
- **torch.compile** (``--compile``): ``torch.compile(model, mode="reduce-overhead")`` on the
  batch dict, warmed on every call first (its compile seconds reported).

Each is timed both ways a user feels it: ``waited`` is the median of the calls, each waited for
(CUDA events; host work before the first launch counts), ``loop`` the milliseconds per call of a
loop over all of them with one wait at the end. ``--iters`` rounds over the calls; layergraph
and the hand-written graph are timed in turns (each call by both, in a rotating order), so
that drift during the run weighs on both alike. Errors: the
largest relative error over the calls against a float32 copy of the model, eager.
``--profile`` adds, for layergraph and the hand-written graph, what a call costs on each side:
the host's milliseconds from the call to its return (no wait), the Python functions with the
most host time (``cProfile``), and from ``torch.profiler`` the device's kernels per call
(:func:`layergraph.bench.profile.profile_call`), their milliseconds and the ten that take most,
so that a gap between the two is seen as host work or as kernels. ``--tiny`` runs a two-layer
model of width 64 in float32 on the CPU, where the graphs are simulated
(:class:`layergraph.testing.SimulatedGraphs`, which refuses what a CUDA capture refuses), so
that every path runs without a GPU; its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import timm
import torch
from siglip2_naflex import wrap_options

import layergraph
from layergraph.bench.profile import host_functions, profile_call
from layergraph.testing import SimulatedGraphs
from layergraph.timing import timed_call
from layergraph.validation import relative_error

Batch = dict[str, torch.Tensor]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def grid(ratio: float, scale: float, patches: int) -> tuple[int, int]:
    """The largest patch grid of ``ratio`` (width / height) within ``patches`` patches, shrunk
    by ``scale`` (an image smaller than the budget), at least 4 patches a side."""
    height = max(4, int(math.sqrt(patches / ratio) * scale))
    width = max(4, int(height * ratio))
    while height * width > patches:
        height, width = height - 1, max(4, int((height - 1) * ratio))
    return height, width


def naflex_batch(rows: int, patches: int, pixels: int, rng: random.Random) -> Batch:
    """``rows`` images of seeded sizes as timm's NaFlex collator pads them to ``patches``."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    data = torch.zeros(rows, patches, pixels)
    coords = torch.zeros(rows, patches, 2, dtype=torch.long)
    valid = torch.zeros(rows, patches, dtype=torch.bool)
    for row in range(rows):
        height, width = grid(2 ** rng.uniform(-1, 1), rng.uniform(0.5, 1.0), patches)
        count = height * width
        data[row, :count] = torch.randn(count, pixels, generator=generator)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        coords[row, :count] = torch.stack([ys.flatten(), xs.flatten()], dim=-1)
        valid[row, :count] = True
    return {"patches": data, "patch_coord": coords, "patch_valid": valid}


def on(batch: Batch, device: torch.device, dtype: torch.dtype) -> Batch:
    return {
        name: value.to(device, dtype=dtype if value.is_floating_point() else value.dtype)
        for name, value in batch.items()
    }


class HandWritten:
    """The split layergraph makes, by hand: embeddings eagerly, one graph per batch size of the
    blocks, norm and head on static inputs (:class:`SimulatedGraphs` on the CPU)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.graphs: dict[tuple[int, ...], tuple[Callable[[], None], list[torch.Tensor], Any]] = {}
        self.simulated = SimulatedGraphs() if device.type != "cuda" else None

    def _tail(self, tokens: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor) -> Any:
        model = self.model
        for block in model.blocks:
            tokens = block(tokens, attn_mask=mask)
        return model.forward_head(model.norm(tokens), patch_valid=valid)

    def __call__(self, batch: Batch) -> torch.Tensor:
        model = self.model
        embeds = model._forward_embeds(
            batch["patches"], batch["patch_coord"], batch["patch_valid"], None
        )
        inputs = [embeds["patches"], embeds["attn_mask"], embeds["patch_valid"]]
        shape = tuple(inputs[0].shape)
        if shape not in self.graphs:
            static = [tensor.clone() for tensor in inputs]
            self.graphs[shape] = self._capture(static)
        replay, static, output = self.graphs[shape]
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        replay()
        return output.clone()

    def _capture(self, static: list[torch.Tensor]) -> tuple[Callable[[], None], list[Any], Any]:
        def tail() -> Any:
            return self._tail(*static)

        if self.simulated is not None:
            backend = self.simulated
            graph, output = backend.capture(tail, backend.new_pool(), 1)
            return (lambda: backend.replay(graph)), static, output
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tail()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = tail()
        return graph.replay, static, output


def timed(
    fns: dict[str, Callable[[Batch], Any]], calls: list[Batch], iters: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Waited median and loop milliseconds per call of each of ``fns`` over ``calls``,
    ``iters`` rounds, taken in turns (each call by each function in a rotating order, each
    round's loop by each function in turn), so that drift during the run weighs on all
    alike."""
    names = list(fns)
    waited: dict[str, list[float]] = {name: [] for name in names}
    loops: dict[str, float] = dict.fromkeys(names, 0.0)
    for round_ in range(iters):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for batch in calls:
            for name in order:
                call = functools.partial(fns[name], batch)
                waited[name].append(timed_call(call, device=device)[1])
        for name in order:
            loops[name] += _loop_ms(fns[name], calls, device)
    return {
        name: {"waited_ms": statistics.median(waited[name]), "loop_ms": loops[name] / iters}
        for name in names
    }


def _loop_ms(fn: Callable[[Batch], Any], calls: list[Batch], device: torch.device) -> float:
    """Milliseconds per call of ``fn`` over ``calls`` back to back, one wait at the end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for batch in calls:
        fn(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) * 1e3 / len(calls)


def profiled(
    fn: Callable[[Batch], Any], calls: list[Batch], device: torch.device, rounds: int = 3
) -> dict[str, Any]:
    """What a call of ``fn`` costs: the median host milliseconds from the call to its return
    (no wait), the ten Python functions with the most host time of their own
    (:func:`layergraph.bench.profile.host_functions`, a pass over the calls), and on a GPU the
    device's kernels per call as :func:`layergraph.bench.profile.profile_call` records them
    over ``rounds`` passes (none on the CPU), with the ten that take the most device time."""
    host = []
    for _ in range(rounds):
        for batch in calls:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn(batch)
            host.append((time.perf_counter() - started) * 1e3)
    batches = itertools.cycle(calls)
    functions = host_functions(lambda: fn(next(batches)), device=device, calls=len(calls), top=10)
    cost: dict[str, Any] = {
        "host_ms": statistics.median(host),
        "host_functions": [dataclasses.asdict(function) for function in functions],
        "device_kernels": 0.0,
        "device_ms": 0.0,
        "top": [],
    }
    if device.type != "cuda":
        return cost

    def one_pass() -> None:
        for batch in calls:
            fn(batch)

    try:
        kernels = profile_call(one_pass, device=device, calls=rounds, longest=10)
    except Exception as error:  # reported, not measured: the timings stand
        return {
            "host_ms": cost["host_ms"],
            "host_functions": cost["host_functions"],
            "error": f"{type(error).__name__}: {error}",
        }
    longest = sorted(
        (kernel for group in kernels.classes for kernel in group.longest),
        key=lambda kernel: -kernel["ms"],
    )[:10]
    return cost | {
        "device_kernels": kernels.kernels / len(calls),
        "device_ms": kernels.busy_ms / len(calls),
        "top": [{"name": kernel["kernel"], "ms": kernel["ms"] / len(calls)} for kernel in longest],
    }


def largest_error(
    fn: Callable[[Batch], Any], calls: list[Batch], reference: list[torch.Tensor]
) -> float:
    return max(
        relative_error(fn(batch).float(), want)
        for batch, want in zip(calls, reference, strict=True)
    )


def run_batch_size(
    args: argparse.Namespace, rows: int, model: torch.nn.Module, reference_model: torch.nn.Module
) -> dict[str, Any]:
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    rng = random.Random(rows)
    pixels = model.embeds.patch_size[0] * model.embeds.patch_size[1] * 3
    host = [naflex_batch(rows, args.patches, pixels, rng) for _ in range(args.calls)]
    calls = [on(batch, device, dtype) for batch in host]
    with torch.inference_mode():
        reference = [reference_model(on(batch, device, torch.float32)).float() for batch in host]
    row: dict[str, Any] = {"batch": rows, "calls": args.calls, "patches": args.patches}
    row["real_patches"] = [int(batch["patch_valid"].sum()) for batch in host]
    backend = SimulatedGraphs() if device.type != "cuda" else None
    options = wrap_options(args.options) | ({"backend": backend} if backend else {})
    graphed = layergraph.wrap(model, **options)
    row["speed_options"] = dict(graphed.speed_options)
    hand = HandWritten(model, device)
    with torch.inference_mode():
        started = time.perf_counter()
        for batch in calls:
            graphed(batch)
        row["layergraph_first_pass_s"] = time.perf_counter() - started
        for batch in calls:
            hand(batch)
        variants: dict[str, Callable[[Batch], Any]] = {"layergraph": graphed, "hand_written": hand}
        with graphed.original():
            row.update(timed({"eager": model}, calls, args.iters, device))
            row["eager_error"] = largest_error(model, calls, reference)
        row.update(timed(variants, calls, args.iters, device))
        for name, fn in variants.items():
            row[f"{name}_error"] = largest_error(fn, calls, reference)
        if args.profile:
            row["profile"] = {name: profiled(fn, calls, device) for name, fn in variants.items()}
    stats = graphed.stats
    row["graphs"] = stats.graphs
    row["keys"] = sorted(str(key) for key in graphed.keys)
    row["eager_calls"] = dict(stats.eager_calls)
    row["capture_s"] = stats.capture_seconds
    graphed.unwrap()
    if args.compile:
        row.update(compiled(model, calls, reference, args.iters, device))
    eager = row["eager"]["waited_ms"]
    for name in ("layergraph", "hand_written", "compile"):
        if isinstance(row.get(name), dict):
            row[f"{name}_speedup"] = eager / row[name]["waited_ms"]
    row["layergraph_vs_hand"] = row["hand_written"]["waited_ms"] / row["layergraph"]["waited_ms"]
    return row


def compiled(
    model: torch.nn.Module,
    calls: list[Batch],
    reference: list[torch.Tensor],
    iters: int,
    device: torch.device,
) -> dict[str, Any]:
    compiled_model = torch.compile(model, mode="reduce-overhead")
    try:
        with torch.inference_mode():
            started = time.perf_counter()
            for _ in range(3):
                for batch in calls:
                    compiled_model(batch)
            seconds = time.perf_counter() - started
            return {
                "compile": timed({"compile": compiled_model}, calls, iters, device)["compile"],
                "compile_error": largest_error(compiled_model, calls, reference),
                "compile_warmup_s": seconds,
            }
    except Exception as error:  # reported, not timed: the other columns stand
        return {"compile": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    finally:
        torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--model", default="naflexvit_base_patch16_gap")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--patches", type=int, default=576, help="patches a row, padded to")
    parser.add_argument(
        "--calls", type=int, default=8, help="batches of other sizes per batch size"
    )
    parser.add_argument("--iters", type=int, default=10, help="rounds over the calls")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--options", default="", help="wrap options, NAME=VALUE,...")
    parser.add_argument(
        "--profile", action="store_true", help="host time and device kernels of the two graphs"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model in float32 on the CPU")
    args = parser.parse_args()
    settings: dict[str, Any] = {}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = DTYPES[args.dtype]
    if args.tiny:
        settings = {"embed_dim": 64, "depth": 2, "num_heads": 2}
        dtype, args.patches, args.calls, args.iters = torch.float32, 64, 3, 2
    torch.manual_seed(0)
    built = timm.create_model(args.model, pretrained=False, **settings).eval()
    reference_model = copy.deepcopy(built).float().to(device)
    model = built.to(device, dtype)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "timm": timm.__version__,
        },
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "settings": vars(args),
        "rows": [],
    }
    for rows in (int(size) for size in args.batch_sizes.split(",")):
        row = run_batch_size(args, rows, model, reference_model)
        result["rows"].append(row)
        columns = ("eager", "layergraph", "hand_written", "compile")
        times = "  ".join(
            f"{name} {row[name]['waited_ms']:.3f}/{row[name]['loop_ms']:.3f}"
            for name in columns
            if isinstance(row.get(name), dict)
        )
        print(
            f"batch {rows}: waited/loop ms  {times}  | speedup {row['layergraph_speedup']:.2f}x, "
            f"vs hand-written {row['layergraph_vs_hand']:.3f}, graphs {row['graphs']}, "
            f"eager calls {row['eager_calls']}, errors lg {row['layergraph_error']:.4f} "
            f"eager {row['eager_error']:.4f}",
            flush=True,
        )
        if isinstance(row.get("compile"), str):
            print(f"  torch.compile: {row['compile']}", flush=True)
        for name, cost in row.get("profile", {}).items():
            if "error" in cost:
                print(f"  {name}: host {cost['host_ms']:.3f} ms a call; {cost['error']}")
                continue
            print(
                f"  {name}: host {cost['host_ms']:.3f} ms a call, device {cost['device_ms']:.3f} "
                f"ms in {cost['device_kernels']:.1f} kernels a call",
                flush=True,
            )
            for kernel in cost["top"]:
                print(f"    {kernel['ms']:.4f} ms  {kernel['name']}")
            print("    host, own ms a call (cProfile):")
            for function in cost["host_functions"]:
                print(f"    {function['own_ms']:.4f} ms  {function['name']}")
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
