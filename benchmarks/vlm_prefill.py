"""Time to first token of a transformers VLM on a stream of requests, eager against wrapped.

    python3 benchmarks/vlm_prefill.py --json prefill.json      # a GPU: Qwen2.5-VL-3B-sized, bf16
    python3 benchmarks/vlm_prefill.py --tiny                   # the same code path, tiny, CPU

``layergraph bench --prefill`` (:func:`layergraph.bench.requests.run_prefill`) on the
``qwen2.5-vl-3b`` example (a 32-layer vision tower of 1280, a 36-layer language model of 2048;
random weights, nothing downloaded): a seeded stream of 60 requests, each a short prompt around
1 to 3 images of up to about 1.4 megapixels, as Qwen2.5-VL's processor lays them out, each
prefill (one forward over the prompt keeping the last position's logits) waited for, through
the VLM as it is and then twice through ``layergraph.wrap(vlm)`` (the first pass observes the
traffic, chooses budgets and captures; the second is the steady state). ``--tiny`` runs a small
VLM of the same shape in float32 on the CPU with simulated graphs, 12 requests of small images,
the wrapper observing 8 calls.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from layergraph.bench.examples import ExampleModel
from layergraph.bench.requests import REQUEST_SIZES, run_prefill
from layergraph_adapters.example_models.packed import (
    PACKED_EXAMPLES,
    PackedExample,
    packed_example_model,
    qwen_inputs,
    qwen_prompt,
)
from layergraph_adapters.kit.tower_specs import TowerExample

TINY_SIZES = ((56, 56), (56, 112), (112, 112), (112, 168), (168, 224))
"""Image sizes (height, width) of the tiny stream."""


TINY_VLM = PackedExample(
    "qwen2_vl",
    TowerExample(
        "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
        {
            **PACKED_EXAMPLES["qwen2.5-vl-3b"].example.settings,
            "vision_config": dict(
                depth=4,
                hidden_size=32,
                num_heads=2,
                intermediate_size=64,
                out_hidden_size=32,
                window_size=56,
                fullatt_block_indexes=[1, 3],
                spatial_merge_size=2,
                patch_size=14,
                temporal_patch_size=2,
            ),
            "text_config": dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=151936,
                rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 3, 3]),
            ),
        },
    ),
    qwen_inputs,
    qwen_prompt,
)
"""Qwen2.5-VL-3B's shape, small: the example VLM ``qwen2.5-vl-tiny``."""


def tiny_vlm() -> ExampleModel:
    """:data:`TINY_VLM` as an example model."""
    return packed_example_model("qwen2.5-vl-tiny", TINY_VLM)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write every number to this file")
    parser.add_argument("--tiny", action="store_true", help="a small VLM in float32")
    parser.add_argument("--requests", type=int, default=None, help="stream length (60; 12 tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--observe-calls",
        type=int,
        default=None,
        help="calls observed before budgets are chosen (the wrapper's default; 8 tiny)",
    )
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("the Qwen2.5-VL-3B-sized VLM needs a CUDA GPU; --tiny runs anywhere")
    observe = args.observe_calls
    report = run_prefill(
        tiny_vlm() if args.tiny else "qwen2.5-vl-3b",
        args.requests or (12 if args.tiny else 60),
        seed=args.seed,
        sizes=TINY_SIZES if args.tiny else REQUEST_SIZES,
        observe_calls=8 if args.tiny and observe is None else observe,
    )
    print(report.to_markdown())
    if args.json:
        report.write_json(args.json)
    return report.to_dict()


if __name__ == "__main__":
    main()
