"""InternViT-300M@448 on one GPU: eager, a hand-written graph, and layergraph per backend.

    python3 benchmarks/internvl.py --json results.json

The model is transformers' ``InternVLVisionModel`` built from the InternViT-300M configuration
with random weights, in bf16. Eager is the unmodified model (transformers' SDPA attention);
the hand-written graph captures that model's whole forward with ``torch.cuda.graph``;
layergraph wraps it with ``adapter="internvl"`` and each attention backend in turn, then with
fused q/k/v projections and with compiled layers (see ``VARIANTS``). Each
figure is the median of many calls timed with CUDA events after warm-up.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

import layergraph
from layergraph.reference import plain_graph
from layergraph.timing import median_ms
from layergraph.validation import relative_error
from layergraph_adapters.internvl import build_internvit

VARIANTS = {
    "sdpa": {"attention": "sdpa"},
    "triton": {"attention": "triton"},
    "fa3": {"attention": "fa3"},
    "auto": {"attention": "auto"},
    "triton+fused_qkv": {"attention": "triton", "fuse_qkv": True},
    "triton+compiled": {"attention": "triton", "compile_layers": True},
}
"""The layergraph configurations timed, by label."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(part) for part in args.batch_sizes.split(",")]
    torch.manual_seed(0)
    model = build_internvit("internvit-300m", torch.bfloat16, "cuda")
    rows = []
    with torch.inference_mode():
        for batch in sizes:
            x = torch.randn(batch, 3, 448, 448, device="cuda", dtype=torch.bfloat16)
            expected = model(pixel_values=x).last_hidden_state
            row = {"batch": batch}
            row["eager_ms"] = median_ms(
                lambda x=x: model(pixel_values=x), device=x.device, iters=args.iters
            )
            by_hand = plain_graph(model, x)
            row["plain_graph_ms"] = median_ms(
                lambda x=x, run=by_hand: run(x), device=x.device, iters=args.iters
            )
            del by_hand
            for attention, options in VARIANTS.items():
                graphed = layergraph.wrap(model, adapter="internvl", batch_sizes=[batch], **options)
                keys = graphed.capture(pixel_values=x, progress=False)
                out = graphed(pixel_values=x).last_hidden_state
                row[f"{attention}_ms"] = median_ms(
                    lambda x=x, g=graphed: g(pixel_values=x), device=x.device, iters=args.iters
                )
                row[f"{attention}_error_vs_transformers"] = relative_error(out, expected)
                row[f"{attention}_kernel"] = graphed.plan.attention_by_key[keys[0]]
                row[f"{attention}_capture_s"] = graphed.stats.capture_seconds
                graphed.unwrap()
            rows.append(row)
            torch.cuda.empty_cache()
    print(f"{'batch':>5} {'eager':>8} {'by hand':>8} " + " ".join(f"{a:>14}" for a in VARIANTS))
    for row in rows:
        cells = " ".join(
            f"{row[f'{a}_ms']:7.3f} {row['eager_ms'] / row[f'{a}_ms']:5.2f}x" for a in VARIANTS
        )
        print(f"{row['batch']:>5} {row['eager_ms']:8.3f} {row['plain_graph_ms']:8.3f} {cells}")
    for row in rows:
        print(
            row["batch"],
            {k: v for k, v in row.items() if k.endswith(("_kernel", "_error_vs_transformers"))},
        )
    if args.json:
        record = {
            "model": "InternViT-300M@448 (random weights, bf16)",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "iters": args.iters,
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)


if __name__ == "__main__":
    main()
