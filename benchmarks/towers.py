"""SigLIP so400m/14@384 and CLIP ViT-L/14@336 on one GPU: eager, by hand, layergraph.

    python3 benchmarks/towers.py --json results.json

Towers are transformers' ``SiglipVisionModel`` and ``CLIPVisionModel`` built from their
configurations with random weights, in bf16. For each batch size: the unmodified model eager;
its whole forward captured by hand with ``torch.cuda.graph``; layergraph with the tower's
adapter. For CLIP also the LLaVA read, hidden state -2: eager with ``output_hidden_states``
against layergraph with ``feature_layers=-2``, which stops one layer early. Medians of many
calls timed with CUDA events after warm-up.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

import layergraph
from layergraph.reference import plain_graph
from layergraph.timing import median_ms
from layergraph_adapters.example_models.towers import TOWER_EXAMPLES
from layergraph_adapters.kit.tower_specs import build_tower

TOWERS = {
    name: (TOWER_EXAMPLES[name][1].tower, TOWER_EXAMPLES[name][1].settings, size)
    for name, size in (("siglip-so400m-384", 384), ("clip-vit-l-336", 336))
}


def measure(name: str, batch: int, iters: int) -> dict[str, object]:
    class_name, settings, size = TOWERS[name]
    torch.manual_seed(0)
    model = build_tower(class_name, settings, torch.bfloat16, "cuda")
    x = torch.randn(batch, 3, size, size, device="cuda", dtype=torch.bfloat16)
    row: dict[str, object] = {"model": name, "batch": batch}
    with torch.inference_mode():
        row["eager_ms"] = median_ms(lambda: model(pixel_values=x), device=x.device, iters=iters)
        by_hand = plain_graph(model, x)
        row["plain_graph_ms"] = median_ms(lambda: by_hand(x), device=x.device, iters=iters)
        graphed = layergraph.wrap(model, batch_sizes=[batch])
        graphed.capture(pixel_values=x, progress=False)
        row["layergraph_ms"] = median_ms(
            lambda: graphed(pixel_values=x), device=x.device, iters=iters
        )
        row["capture_s"] = graphed.stats.capture_seconds
        graphed.unwrap()
        if class_name == "CLIPVisionModel":
            row["eager_hidden_states_ms"] = median_ms(
                lambda: model(pixel_values=x, output_hidden_states=True),
                device=x.device,
                iters=iters,
            )
            graphed = layergraph.wrap(model, feature_layers=-2, batch_sizes=[batch])
            graphed.capture(pixel_values=x, output_hidden_states=True, progress=False)
            row["layergraph_layer_minus_two_ms"] = median_ms(
                lambda: graphed(pixel_values=x, output_hidden_states=True),
                device=x.device,
                iters=iters,
            )
            graphed.unwrap()
    row["speedup"] = row["eager_ms"] / row["layergraph_ms"]
    row["plain_graph_speedup"] = row["eager_ms"] / row["plain_graph_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name in TOWERS:
        for batch in args.batch_sizes.split(","):
            rows.append(measure(name, int(batch), args.iters))
            torch.cuda.empty_cache()
    for row in rows:
        print(
            {
                key: round(value, 4) if isinstance(value, float) else value
                for key, value in row.items()
            }
        )
    if args.json:
        record = {
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
