"""layergraph's graphs replayed after torch.compile(mode="reduce-overhead") ran the same model.

    python3 benchmarks/compile_coexistence.py --model siglip-so400m-384 --batch-sizes 1,2,4
    python3 benchmarks/compile_coexistence.py --disturb clear-cublas
    compute-sanitizer --tool memcheck python3 benchmarks/compile_coexistence.py

Builds an adapter's example model (random weights, bf16), wraps it and captures every batch
size, then disturbs the process and finally replays layergraph's graphs and compares them with
eager outputs computed at the start. ``--disturb compile`` (the default) compiles the unwrapped
model with ``mode="reduce-overhead"`` and runs it three times per batch size (Inductor records
its own CUDA graphs, in CUDA-graph trees, and clears cuBLAS's workspaces around each
recording); ``--disturb clear-cublas`` only clears cuBLAS's workspaces and empties PyTorch's
cache, which is what would fault if a graph's workspace lived outside its pool;
``--disturb compile-without-trees`` compiles with ``triton.cudagraph_trees`` off. Prints one line
per batch size and exits non-zero if a replay fails or differs from eager. The CUDA test
``test_graphs_stay_right_beside_torch_compile_reduce_overhead`` runs it in a child process.
"""

from __future__ import annotations

import argparse
import sys

import torch

import layergraph
from layergraph.plugins import get_registry
from layergraph.validation import DEFAULT_TOLERANCE, first_tensor, relative_error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="siglip-so400m-384")
    parser.add_argument("--batch-sizes", default="1,2,4")
    parser.add_argument(
        "--disturb", default="compile", choices=["compile", "clear-cublas", "compile-without-trees"]
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    device = torch.device("cuda")
    example = get_registry().example_model(args.model)
    torch.manual_seed(0)
    model = example.build(torch.bfloat16, device)
    inputs = {batch: example.inputs(batch, torch.bfloat16, device) for batch in sizes}
    failures = 0
    with torch.inference_mode():
        expected = {b: first_tensor(model(*a, **k)) for b, (a, k) in inputs.items()}
        graphed = layergraph.wrap(model, adapter=example.adapter, batch_sizes=sizes)
        graphed.capture(*inputs[sizes[0]][0], progress=False, **inputs[sizes[0]][1])
        if args.disturb == "clear-cublas":
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


if __name__ == "__main__":
    sys.exit(main())
