"""layergraph's graphs replayed after other CUDA-graph users in the process did their work.

    python3 benchmarks/compile_coexistence.py --model siglip-so400m-384 --batch-sizes 1,2,4
    python3 benchmarks/compile_coexistence.py --disturb foreign-graph
    compute-sanitizer --tool memcheck python3 benchmarks/compile_coexistence.py

Builds an adapter's example model (random weights, bf16), wraps it and captures every batch
size, disturbs the process, and finally replays layergraph's graphs and compares them with
eager outputs computed at the start. The disturbances (``--disturb``):

- ``compile`` (the default): compiles the unwrapped model with ``mode="reduce-overhead"`` and
  runs it three times per batch size (Inductor records its own CUDA graphs, in CUDA-graph
  trees, and clears cuBLAS's workspaces around each recording);
- ``compile-without-trees``: the same with ``triton.cudagraph_trees`` off;
- ``clear-cublas``: only clears cuBLAS's workspaces and empties PyTorch's cache, which is what
  would fault if a graph's workspace lived outside its pool;
- ``foreign-graph``: before wrapping, a hand-written graph of the model is captured on
  PyTorch's default capture stream; after layergraph's captures it is released, cuBLAS's
  workspaces are cleared (as torch.compile does) and the cache emptied: a graph that had
  borrowed the foreign graph's cuBLAS workspace, in the foreign graph's pool, would fault;
- ``other-model``: the same with a second wrapped copy of the model, unwrapped after the
  first one's captures.

Prints one line per batch size and exits non-zero if a replay fails or differs from eager. The
CUDA tests ``test_graphs_stay_right_beside_*`` run it in a child process.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from collections.abc import Callable

import torch

import layergraph
from layergraph.bench.examples import example_model
from layergraph.reference import plain_graph
from layergraph.validation import DEFAULT_TOLERANCE, first_tensor, relative_error

DISTURBANCES = ("compile", "compile-without-trees", "clear-cublas", "foreign-graph", "other-model")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="siglip-so400m-384")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument("--disturb", default="compile", choices=DISTURBANCES)
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    device = torch.device("cuda")
    example = example_model(args.model)
    torch.manual_seed(0)
    model = example.build(torch.bfloat16, device)
    inputs = {batch: example.inputs(batch, torch.bfloat16, device) for batch in sizes}
    first_args, first_kwargs = inputs[sizes[0]]
    failures = 0
    with torch.inference_mode():
        expected = {b: first_tensor(model(*a, **k)) for b, (a, k) in inputs.items()}
        release_neighbour = _neighbour(args.disturb, model, example.adapter, sizes, inputs)
        graphed = layergraph.wrap(model, adapter=example.adapter, batch_sizes=sizes)
        graphed.capture(*first_args, progress=False, **first_kwargs)
        if release_neighbour is not None:
            release_neighbour()
        elif args.disturb == "clear-cublas":
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        else:
            torch._inductor.config.triton.cudagraph_trees = args.disturb == "compile"
            with graphed.original() as original:
                compiled = torch.compile(original, mode="reduce-overhead", dynamic=False)
                for call_args, call_kwargs in inputs.values():
                    for _ in range(3):
                        compiled(*call_args, **call_kwargs)
        torch.cuda.synchronize()
        for batch, (call_args, call_kwargs) in inputs.items():
            got = first_tensor(graphed(*call_args, **call_kwargs))
            torch.cuda.synchronize()
            error = relative_error(got, expected[batch])
            failures += not error <= DEFAULT_TOLERANCE[torch.bfloat16]
            print(
                f"{args.model}, {args.disturb}, batch {batch}: relative error {error:.2e}",
                flush=True,
            )
        graphed.unwrap()
    return 1 if failures else 0


def _neighbour(
    disturb: str,
    model: torch.nn.Module,
    adapter: str,
    sizes: list[int],
    inputs: dict[int, tuple[tuple, dict]],
) -> Callable[[], None] | None:
    """Start the graphs of ``foreign-graph`` or ``other-model``; return what releases them."""
    first_args, first_kwargs = inputs[sizes[0]]
    if disturb == "foreign-graph":
        holder = [plain_graph(model, *first_args, **first_kwargs)]
        holder[0](*first_args, **first_kwargs)
    elif disturb == "other-model":
        other = layergraph.wrap(copy.deepcopy(model), adapter=adapter, batch_sizes=sizes)
        other.capture(*first_args, progress=False, **first_kwargs)
        holder = [other]
    else:
        return None

    def release() -> None:
        if isinstance(holder[0], layergraph.GraphedModule):
            holder[0].unwrap()
        holder.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()

    return release


if __name__ == "__main__":
    sys.exit(main())
