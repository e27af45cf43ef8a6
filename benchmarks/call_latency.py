"""Latency of one call with a wait for its result, and the throughput of a loop, on a GPU.

For each model and batch size: eager, a hand-written wrapper (copy the input into a
``torch.cuda.graph``'s static input, replay, clone the output) and ``layergraph.wrap`` with its
defaults, graphs captured ahead. Two ways a user feels a call:

- ``wait``: each call is followed by a wait for its result, so the host work before a replay
  shows; median of ``--iters`` calls (:func:`layergraph.timing.waited_ms`);
- ``loop``: calls back to back, each between its own two events, with one wait at the end
  (:func:`layergraph.timing.median_ms`), which hides host work behind the GPU's.

``--host-profile N`` also runs N layergraph calls under ``cProfile``
(:func:`layergraph.bench.profile.host_functions`) and prints the functions whose own host time
is largest: where the wrapper's host work before a replay goes.

    python3 benchmarks/call_latency.py --json latency.json --label main
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

import layergraph
from layergraph.bench.examples import example_model
from layergraph.bench.profile import host_functions
from layergraph.reference import plain_graph
from layergraph.timing import median_ms, waited_ms

MODELS = ("vit_base_patch16_224", "clip-vit-l-336")


def hand_written(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Copy in, replay, clone out: what a user writes around one ``torch.cuda.graph``."""
    run = plain_graph(model, *args, **kwargs)

    def call() -> Any:
        out = run(*args, **kwargs)
        return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)

    return call


def measure(name: str, batch: int, iters: int, host_profile: int = 0) -> list[dict[str, Any]]:
    example = example_model(name)
    device = torch.device("cuda")
    model = example.build(torch.bfloat16, device)
    args, kwargs = example.inputs(batch, torch.bfloat16, device)
    rows = []
    with torch.inference_mode():
        graphed = layergraph.wrap(model)
        graphed.capture(*args, batch_sizes=[batch], progress=False, **kwargs)
        with graphed.original() as original:
            methods = {
                "eager": lambda: original(*args, **kwargs),
                "hand-written": hand_written(original, args, kwargs),
            }
            for method, fn in methods.items():
                rows.append(_row(name, batch, method, fn, iters))
        rows.append(_row(name, batch, "layergraph", lambda: graphed(*args, **kwargs), iters))
        assert graphed.stats.eager_total == 0, dict(graphed.stats.eager_calls)
        if host_profile:
            print_host_profile(
                f"{name}, batch {batch}", lambda: graphed(*args, **kwargs), host_profile
            )
    return rows


def print_host_profile(title: str, fn: Callable[[], Any], calls: int, top: int = 20) -> None:
    """Print the ``top`` functions by their own host time over ``calls`` calls of ``fn``."""
    print(f"host profile of {calls} layergraph calls: {title}")
    print(f"{'own ms':>8} {'total ms':>9} {'calls':>6}  function")
    for function in host_functions(fn, device=torch.device("cuda"), calls=calls, top=top):
        print(
            f"{function.own_ms:8.4f} {function.total_ms:9.4f} {function.calls:6.1f}  "
            f"{function.name}"
        )


def _row(name: str, batch: int, method: str, fn: Callable[[], Any], iters: int) -> dict[str, Any]:
    return {
        "model": name,
        "batch": batch,
        "method": method,
        "wait_ms": waited_ms(fn, device=torch.device("cuda"), warmup=20, iters=iters),
        "loop_ms": median_ms(fn, device=torch.device("cuda"), iters=iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--label", default="", help="names this code version in the output")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--host-profile", type=int, default=0, metavar="N", help="profile N layergraph calls"
    )
    options = parser.parse_args()
    rows = [
        {"label": options.label, **row}
        for name in options.models.split(",")
        for batch in map(int, options.batch_sizes.split(","))
        for row in measure(name, batch, options.iters, options.host_profile)
    ]
    print(f"| {options.label} | model | batch | method | wait ms | loop ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {options.label} | {row['model']} | {row['batch']} | {row['method']} | "
            f"{row['wait_ms']:.3f} | {row['loop_ms']:.3f} |"
        )
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
