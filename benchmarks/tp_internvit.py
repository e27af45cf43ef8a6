"""InternViT split across the GPUs of a host, graphed: the torchrun recipe.

    torchrun --nproc-per-node 2 benchmarks/tp_internvit.py --model internvit-6b --json tp.json

Every rank builds the same tower from its configuration (random weights, bf16, same seed) on
its own GPU, splits it with :func:`layergraph_adapters.kit.internvl_tp.parallelize_internvit` over
NCCL, wraps it with ``adapter="internvl"`` and captures every batch size. Each graph holds the
layers' all-reduces. All ranks are fed the same tiles and replay the same keys in the same
order. Rank 0 prints graph-against-eager errors and the latency of tensor-parallel eager and of
the graphs (medians of CUDA-event timings), and writes them as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import layergraph
from layergraph.timing import median_ms
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.internvl import build_internvit
from layergraph_adapters.kit.internvl_tp import parallelize_internvit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="internvit-6b", help="internvit-300m or internvit-6b")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    tower = build_internvit(args.model, torch.bfloat16, "cuda")
    parallelize_internvit(tower, mesh)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    graphed = layergraph.wrap(
        tower, adapter="internvl", attention=args.attention, batch_sizes=sizes
    )
    device = torch.device("cuda")
    rows = []
    with torch.inference_mode():
        graphed.capture(pixel_values=_tiles(1), progress=False)
        for batch in sizes:
            x = _tiles(batch)
            got = graphed(pixel_values=x).last_hidden_state
            eager = graphed.plan.region(pixel_values=x).last_hidden_state
            rows.append(
                {
                    "batch": batch,
                    "relative_error": relative_error(got, eager),
                    "tp_eager_ms": median_ms(
                        lambda x=x: graphed.plan.region(pixel_values=x),
                        device=device,
                        iters=args.iters,
                    ),
                    "tp_graph_ms": median_ms(
                        lambda x=x: graphed(pixel_values=x), device=device, iters=args.iters
                    ),
                }
            )
    worst = max(row["relative_error"] for row in rows)
    if not worst <= DEFAULT_TOLERANCE[torch.bfloat16]:
        raise SystemExit(f"rank {rank}: graph differs from tensor-parallel eager by {worst:.3g}")
    if rank == 0:
        record = {
            "model": args.model,
            "ranks": world,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "attention": sorted(set(graphed.plan.attention_by_key.values())),
            "rows": rows,
        }
        print(json.dumps(record, indent=2))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(record, handle, indent=2)
    # NCCL cannot tear down a communicator that a live graph still holds: drop the graphs first.
    graphed.unwrap()
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _tiles(batch: int) -> torch.Tensor:
    """The same random tiles on every rank."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    return torch.randn(batch, 3, 448, 448, device="cuda", dtype=torch.bfloat16, generator=generator)


if __name__ == "__main__":
    main()
