"""PyTorch's SDPA backends on the benchmark towers' attention shapes, and in a whole tower.

    python3 benchmarks/sdpa_backends.py --batch-sizes 1,32 --json sdpa.json

For each tower's attention shape (heads, head dim and tokens of vit_base, SigLIP so400m and
InternViT-300M): ``scaled_dot_product_attention`` under each backend that can run it (cuDNN,
flash, memory-efficient), with q, k and v taken from one fused projection as the towers do and
the output brought back to ``[batch, tokens, width]`` as their attention modules do; inside a
CUDA graph of 10 calls, median of 20 replays; with the output's strides, which decide whether
that last step copies. Then the SigLIP tower, wrapped with ``compile_region`` and ``fuse_qkv``,
captured under each backend: median replay latency and relative error against eager.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import layergraph
from layergraph.bench.examples import example_model
from layergraph.timing import captured_ms, median_ms
from layergraph.validation import first_tensor, relative_error

SHAPES = {
    "vit_base_patch16_224": (12, 64, 197),
    "siglip-so400m-384": (16, 72, 729),
    "internvit-300m": (16, 64, 1025),
}
"""Heads, head dim and tokens per image of each tower's attention."""

BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention_ms(batch: int, heads: int, head_dim: int, tokens: int, backend: str) -> dict:
    """One attention call, timed inside a graph; ``ms`` is ``None`` if the backend refused."""
    width = heads * head_dim
    qkv = torch.randn(batch, tokens, 3 * width, device="cuda", dtype=torch.bfloat16)

    def attend() -> torch.Tensor:
        q, k, v = (
            part.view(batch, tokens, heads, head_dim).transpose(1, 2)
            for part in qkv.chunk(3, dim=-1)
        )
        return F.scaled_dot_product_attention(q, k, v)

    def call() -> torch.Tensor:
        return attend().transpose(1, 2).reshape(batch, tokens, width)

    chosen = BACKENDS[backend]
    context = sdpa_kernel([chosen]) if chosen is not None else contextlib.nullcontext()
    with context:
        try:
            call()
        except RuntimeError as error:
            return {"ms": None, "refused": str(error).splitlines()[0]}
        raw = attend()
        ms = captured_ms(call, device=torch.device("cuda"), replays=20)
    return {
        "ms": ms,
        "output_strides": list(raw.stride()),
        "output_copied": not raw.transpose(1, 2).is_contiguous(),
    }


def siglip_tower(batch_sizes: list[int]) -> list[dict]:
    """SigLIP wrapped with compile_region and fuse_qkv, captured under each backend."""
    example = example_model("siglip-so400m-384")
    rows = []
    for backend, chosen in BACKENDS.items():
        torch.manual_seed(0)
        model = example.build(torch.bfloat16, torch.device("cuda"))
        context = sdpa_kernel([chosen]) if chosen is not None else contextlib.nullcontext()
        with torch.inference_mode(), context:
            graphed = layergraph.wrap(
                model,
                adapter=example.adapter,
                batch_sizes=batch_sizes,
                compile_region=True,
                fuse_qkv=True,
            )
            for batch in batch_sizes:
                args, kwargs = example.inputs(batch, torch.bfloat16, torch.device("cuda"))
                with graphed.original() as original:
                    expected = first_tensor(original(*args, **kwargs))
                try:
                    got = first_tensor(graphed(*args, **kwargs))
                except RuntimeError as error:
                    rows.append({"backend": backend, "batch": batch, "refused": str(error)[:200]})
                    continue
                rows.append(
                    {
                        "backend": backend,
                        "batch": batch,
                        "ms": median_ms(
                            lambda g=graphed, a=args, k=kwargs: g(*a, **k),
                            device=torch.device("cuda"),
                            iters=50,
                        ),
                        "relative_error": relative_error(got, expected),
                        "eager_calls": graphed.stats.eager_total,
                    }
                )
                print(rows[-1], flush=True)
            graphed.unwrap()
        torch._dynamo.reset()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-tower", action="store_true", help="attention calls only")
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    attention = []
    for model, (heads, head_dim, tokens) in SHAPES.items():
        for batch in sizes:
            for backend in BACKENDS:
                row = {"model": model, "batch": batch, "backend": backend}
                row.update(attention_ms(batch, heads, head_dim, tokens, backend))
                attention.append(row)
                print(row, flush=True)
    results["attention"] = attention
    if not args.no_tower:
        results["siglip_tower"] = siglip_tower(sizes)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
