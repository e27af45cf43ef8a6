"""transformers' ViTModel graphed whole by a plugin adapter: speed and error against eager.

ViT-Base (google/vit-base-patch16-224's configuration, random weights, bf16) at each batch
size: eager; a hand-written ``torch.cuda.graph``; layergraph through a one-class plugin
adapter (the whole forward in one graph, as the adapter tutorial writes it); and layergraph
again with the plugins' capture contexts switched off, which is how transformers 5.9 to 5.17
are captured without layergraph's ``transformers`` plugin (their mask helpers build a mask
under capture that sends attention to SDPA's float32 math path). Relative errors are against
a float32 copy of the model. Loop times (:func:`layergraph.timing.median_ms`).

    python3 benchmarks/vit_model.py --json vit-model.json
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch
import transformers

import layergraph
from layergraph.plugins import AdapterRegistry
from layergraph.reference import plain_graph
from layergraph.timing import median_ms
from layergraph.validation import relative_error


class WholeViT(layergraph.Adapter):
    """The whole model in one graph."""

    name = "whole-vit"

    def plan(self, model: torch.nn.Module, context: layergraph.PlanContext) -> Any:
        return layergraph.WholeForward(model)


def measure(batch: int, iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(), add_pooling_layer=False)
    reference = copy.deepcopy(model).to("cuda", torch.float32).eval()
    model = model.to("cuda", torch.bfloat16).eval()
    pixels = torch.randn(batch, 3, 224, 224, device="cuda")
    x = pixels.to(torch.bfloat16)
    row: dict[str, Any] = {"batch": batch}
    with torch.inference_mode():
        want = reference(pixel_values=pixels).last_hidden_state
        row["eager_ms"] = median_ms(lambda: model(pixel_values=x), device=x.device, iters=iters)
        row["eager_error"] = relative_error(model(pixel_values=x).last_hidden_state, want)
        by_hand = plain_graph(model, pixel_values=x)
        row["hand_written_ms"] = median_ms(
            lambda: by_hand(pixel_values=x), device=x.device, iters=iters
        )
        row["hand_written_error"] = relative_error(by_hand(pixel_values=x).last_hidden_state, want)
        for label, with_contexts in (("layergraph", True), ("without_capture_contexts", False)):
            original = AdapterRegistry.capture_contexts
            if not with_contexts:
                AdapterRegistry.capture_contexts = lambda self, model: []
            try:
                graphed = layergraph.wrap(model, adapter=WholeViT())
                got = graphed(pixel_values=x).last_hidden_state
            finally:
                AdapterRegistry.capture_contexts = original
            row[f"{label}_ms"] = median_ms(
                lambda graphed=graphed: graphed(pixel_values=x), device=x.device, iters=iters
            )
            row[f"{label}_error"] = relative_error(got, want)
            row[f"{label}_served"] = sorted({way for (_, way) in graphed.stats.served})
            row[f"{label}_measured"] = str(graphed.stats.costs.get(batch))
            graphed.unwrap()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print("vit_model.py needs a CUDA GPU")
        return
    rows = [measure(int(b), options.iters) for b in options.batch_sizes.split(",")]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if options.json:
        with open(options.json, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
