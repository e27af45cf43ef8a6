"""Waited latency of example models, run once under each of two installs, to catch a regression.

    python3 benchmarks/regression.py --models vit-base-224,clip-vit-l-336 --batch-sizes 1,32 \
        --json after.json
    python3 benchmarks/regression.py --models qwen2.5-vl-7b --image-size 896x896 --json after.json

Runs :func:`layergraph.bench.run_benchmark` for each model in turn (eager, layergraph and the
hand-written graph, each call waited for and in a loop) and writes, after every model, one
record per model: its rows, the plan builds each ``wrap`` made (instances of
:class:`~layergraph.adapter.CapturePlan` created while it ran) and the speed options each
``wrap`` chose. The script only uses ``run_benchmark``, its ``_measure`` and ``CapturePlan``,
which every release since 0.2 has, so the same file times the code before a change and after
it: run it with each install's Python, on the same machine, and compare the records. A model
that fails gets a record with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import layergraph
import layergraph.bench.run as bench_run
from layergraph.adapter import CapturePlan
from layergraph.bench import run_benchmark


@contextlib.contextmanager
def counted_wraps(wraps: list[dict[str, Any]]) -> Iterator[None]:
    """Record, for each ``wrap`` the benchmark makes, the plans it built (the outermost
    ``__init__`` of each :class:`~layergraph.adapter.CapturePlan` it made) and the speed
    options it chose."""
    original_wrap = bench_run.wrap

    def counting_wrap(*args: Any, **kwargs: Any) -> Any:
        built = [0]

        def count(frame: Any, event: str, arg: Any) -> None:
            if event != "call" or frame.f_code.co_name != "__init__":
                return
            plan, caller = frame.f_locals.get("self"), frame.f_back
            chained = caller is not None and caller.f_code.co_name == "__init__"
            if isinstance(plan, CapturePlan) and not (
                chained and caller.f_locals.get("self") is plan
            ):
                built[0] += 1

        sys.setprofile(count)
        try:
            graphed = original_wrap(*args, **kwargs)
        finally:
            sys.setprofile(None)
        options = dict(getattr(graphed, "speed_options", {}) or {})
        wraps.append({"plan_builds": built[0], "speed_options": options})
        return graphed

    bench_run.wrap = counting_wrap
    try:
        yield
    finally:
        bench_run.wrap = original_wrap


@contextlib.contextmanager
def without_hand_graph(skip: bool) -> Iterator[None]:
    """With ``skip``, time no hand-written graph: for a tower whose whole forward a CUDA stream
    cannot capture, in a tree whose benchmark does not know it (the capture fails and leaves
    the process unable to draw random numbers)."""
    original_measure = bench_run._measure

    def measure_without(*args: Any, **kwargs: Any) -> Any:
        return original_measure(*args, **{**kwargs, "by_hand": False})

    bench_run._measure = measure_without if skip else original_measure
    try:
        yield
    finally:
        bench_run._measure = original_measure


def measure(
    name: str,
    batch_sizes: list[int],
    image_size: tuple[int, int] | None,
    iters: int,
    skip_hand_graph: bool = False,
) -> dict[str, Any]:
    """One model's record: its rows and wraps, or the error that stopped it."""
    wraps: list[dict[str, Any]] = []
    record: dict[str, Any] = {"model": name, "image_size": image_size, "wraps": wraps}
    try:
        with counted_wraps(wraps), without_hand_graph(skip_hand_graph):
            report = run_benchmark(name, batch_sizes, iters=iters, image_size=image_size)
        record["rows"] = [asdict(row) for row in report.rows]
    except Exception:  # a failing model is recorded and the run goes on
        record["error"] = traceback.format_exc(limit=4)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated example model names")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--image-size", help="HEIGHTxWIDTH, for towers of any image size")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--no-hand-graph", action="store_true", help="time no hand-written graph of the forward"
    )
    parser.add_argument("--json", type=Path, required=True, help="records appended to this file")
    args = parser.parse_args(argv)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    image_size = None
    if args.image_size:
        height, width = args.image_size.lower().split("x")
        image_size = (int(height), int(width))
    records = json.loads(args.json.read_text()) if args.json.exists() else []
    for name in args.models.split(","):
        record = measure(name, batch_sizes, image_size, args.iters, args.no_hand_graph)
        record["layergraph"] = layergraph.__version__
        records.append(record)
        args.json.write_text(json.dumps(records, indent=1))
        rows = record.get("rows", [])
        summary = "; ".join(
            f"b{row['batch']} eager {row['eager_wait_ms']} hand {row['plain_graph_wait_ms']} "
            f"layergraph {row['layergraph_wait_ms']} ({row['layergraph_served']})"
            for row in rows
        )
        builds = [w["plan_builds"] for w in record["wraps"]]
        print(
            f"{name} {args.image_size or ''}: {summary or record.get('error')} builds {builds}",
            flush=True,
        )
    return records


if __name__ == "__main__":
    main()
