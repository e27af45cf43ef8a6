"""One layer's attention over packed sequences at the Qwen towers' head dims, on one GPU: each
packed backend layergraph offers to a plan that prepares its backends (``cudnn``, cuDNN's ragged
SDPA, where ``nvidia-cudnn-frontend`` is installed) and the per-image SDPA transformers' towers
run, each inside a CUDA graph.

    python3 benchmarks/ragged_attention.py [--json ragged.json]

Each case is a budget's room (tokens, sequence slots, longest sequence) and the sequences of a
call in it, 16 heads, bfloat16: Qwen3-VL's head dim 72 (one 896x896 or 1344x1008 image, three
1280x960 images, mixed sizes) and Qwen2.5-VL's 80 (one 1176x896 image's frames and its
windows). Times are :func:`layergraph.timing.captured_ms` medians (10 calls captured in one
graph, 5 replays); errors are relative to a float32 per-sequence SDPA of the same inputs, over
the real tokens. The per-image SDPA is what eager runs: one graph per packing, so it is the
bar the graph's single-kernel backends try to meet, not a backend a budget's graph could use.
The dense block-mask backend is timed twice: under PyTorch's own choice of SDPA kernel, and with
cuDNN's forced.
A backend that cannot run, or fails, is listed with the reason.
What this does not do: time a whole tower (``benchmarks/option_ab.py`` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from layergraph.attention import PackedLayout, SequenceLayout
from layergraph.attention.backends import packed_backends
from layergraph.attention.layout import padded_offsets
from layergraph.plugins import get_registry
from layergraph.timing import captured_ms
from layergraph.validation import relative_error

HEADS = 16
CASES: list[tuple[str, int, int, list[int]]] = [
    # name, head dim, room tokens, sequence lengths (slots: 8, or the windows' count)
    ("qwen3-vl 896x896", 72, 3136, [3136]),
    ("qwen3-vl 896x896 in 3200", 72, 3200, [3136]),
    ("qwen3-vl 1344x1008", 72, 5376, [5376]),
    ("qwen3-vl 3 x 1280x960", 72, 14400, [4800, 4800, 4800]),
    ("qwen3-vl mixed", 72, 8192, [4096, 1024, 2304, 256]),
    ("qwen2.5-vl 1176x896 frames", 80, 5376, [5376]),
    ("qwen2.5-vl 1176x896 windows", 80, 5376, [64] * 84),
]


def per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Each sequence's SDPA on its own (``[1, heads, length, head_dim]``), as eager runs them."""
    outs, start = [], 0
    for length in lengths:
        part = [t[start : start + length].transpose(0, 1)[None] for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
        start += length
    return torch.cat(outs)


def run_case(name: str, head_dim: int, tokens: int, lengths: list[int]) -> dict[str, Any]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    slots = max(8, len(lengths))
    layout = PackedLayout(tokens, slots, max(lengths))
    real = sum(lengths)
    q, k, v = torch.randn(3, tokens, HEADS, head_dim, device=device, dtype=dtype).unbind(0)
    want = per_sequence(q.float(), k.float(), v.float(), lengths)
    offsets = padded_offsets(tuple(lengths), slots)
    row: dict[str, Any] = {"case": name, "head_dim": head_dim, "tokens": tokens, "lengths": lengths}
    results: dict[str, Any] = {}

    def measure(label: str, fn: Any, output: Any) -> None:
        try:
            with torch.inference_mode():
                ms = captured_ms(fn, device=device, calls=10, replays=5)
                got = output()
                error = relative_error(got[:real].float(), want)
            results[label] = {"ms": ms, "error": error}
        except Exception as failure:  # a refused graph or capture is a result here
            results[label] = {"failed": f"{type(failure).__name__}: {failure}"[:300]}
            torch.cuda.synchronize()

    holder: dict[str, torch.Tensor] = {}
    measure(
        "per-image sdpa (eager)",
        lambda: holder.__setitem__("out", per_sequence(q, k, v, lengths)),
        lambda: holder["out"],
    )
    candidates = packed_backends(get_registry().attention_backends(), "auto", dense=True)
    sequences = SequenceLayout((tokens,))
    for backend in candidates:
        reason = backend.unavailable_reason(device, dtype, head_dim, sequences)
        if reason is not None or (backend.largest_room and tokens > backend.largest_room):
            results[backend.name] = {"failed": reason or "room above its largest"}
            continue
        metadata = backend.default_metadata(layout, device)
        metadata.cu_seqlens.copy_(offsets)
        if metadata.seq_lens is not None:
            metadata.seq_lens.copy_(offsets.diff())
        workspace = torch.zeros_like(q) if backend.needs_workspace else None
        backend.prepare(metadata, q)
        slot: dict[str, torch.Tensor] = {}

        def attend(backend=backend, metadata=metadata, workspace=workspace, slot=slot) -> None:
            slot["out"] = backend(
                q,
                k,
                v,
                layout=sequences,
                metadata=metadata,
                workspace=workspace,
                scale=head_dim**-0.5,
            )

        measure(backend.implementation, attend, lambda slot=slot: slot["out"])
        if backend.name == "sdpa_dense_masked":
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                measure(f"{backend.name}, cuDNN forced", attend, lambda slot=slot: slot["out"])
    row["methods"] = results
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to this path")
    args = parser.parse_args()
    rows = []
    for case in CASES:
        row = run_case(*case)
        rows.append(row)
        print(f"{row['case']}  (head dim {row['head_dim']}, {row['tokens']} tokens)", flush=True)
        for label, result in row["methods"].items():
            if "failed" in result:
                print(f"    {label:<44} failed: {result['failed']}")
            else:
                print(f"    {label:<44} {result['ms']:8.3f} ms  error {result['error']:.2e}")
    if args.json:
        record = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "command": " ".join(["python3", *sys.argv]),
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
