"""Time the Triton varlen attention kernel against PyTorch SDPA's flash backend, on one GPU.

For vision-encoder shapes (sequences of 1025 tokens: InternViT 448x448 tiles; head dims 72 and
80 of SigLIP so400m and the Qwen towers), bf16, each case times SDPA (flash backend, contiguous
[B, H, S, D] inputs) and our kernel on packed [B*S, H, D] views of one fused qkv tensor, with
the default config and a few candidates (and each of them with the head dim in two tiles,
``split_head_dim``, where that is narrower than the next power of two), and checks our output
against SDPA's. Times are medians of ``triton.testing.do_bench`` (CUDA
events, warm-up first); FLOPs are 4*B*H*S*S*D.

    python3 benchmarks/attention_kernel.py --json $OUT/attn.json
    python3 benchmarks/attention_kernel.py --head-dims 72,80 --isolate   # each case apart

``--isolate`` runs each case in a process of its own with ``CUDA_LAUNCH_BLOCKING=1``, so that
a config that faults on the device is named (the first row of its case with an error) and the
other cases still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from layergraph.attention.triton_varlen import (
    VarlenConfig,
    default_config,
    head_dim_tiles,
    varlen_attention,
)

CASES = [
    (8, 1025, 16, 64),
    (8, 1025, 8, 128),
    (1, 1025, 16, 64),
    (1, 1025, 8, 128),
    (8, 1025, 16, 80),  # head dim padded to 128 inside the kernel, or split as 64 + 16
    (4, 1024, 16, 72),  # SigLIP so400m's and Qwen3-VL's head dim: 128, or 64 + 16
    (1, 4096, 16, 80),  # Qwen2.5-VL's full attention over one 896x896 image
    (1, 4096, 16, 72),
]
CANDIDATES = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 4, 3),
    (128, 128, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 3),
    (64, 128, 4, 3),
]


def tflops(batch: int, seq: int, heads: int, head_dim: int, ms: float) -> float:
    return 4 * batch * heads * seq * seq * head_dim / (ms * 1e-3) / 1e12


def bench(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def run_case(batch: int, seq: int, heads: int, head_dim: int, dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    tokens, scale = batch * seq, head_dim**-0.5
    qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", dtype=dtype)
    q, k, v = qkv.unbind(1)
    out = torch.empty(tokens, heads, head_dim, device="cuda", dtype=dtype)
    lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
    cu = torch.zeros(batch + 1, device="cuda", dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    qb, kb, vb = (
        t.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous() for t in qkv.unbind(1)
    )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = scaled_dot_product_attention(qb, kb, vb, scale=scale)
        sdpa_ms = bench(lambda: scaled_dot_product_attention(qb, kb, vb, scale=scale))
    ref = ref.transpose(1, 2).reshape(tokens, heads, head_dim).float()
    shape = dict(batch=batch, seq=seq, heads=heads, head_dim=head_dim, dtype=str(dtype))
    rows = [dict(shape, impl="sdpa_flash", config=None, ms=sdpa_ms, rel_err=0.0)]
    default = default_config(head_dim)
    configs = [default] + [c for c in (VarlenConfig(*a) for a in CANDIDATES) if c != default]
    if head_dim_tiles(head_dim, split=True)[1]:  # each config again, the head dim in two tiles
        configs += [replace(config, split_head_dim=True) for config in configs]
    configs = list(dict.fromkeys(configs))  # the default may be one of the candidates
    for config in configs:
        row = dict(shape, impl="triton_varlen", config=asdict(config), default=config == default)
        print(f"running {describe(row['config'])}", file=sys.stderr, flush=True)
        try:
            out.fill_(float("nan"))
            varlen_attention(q, k, v, out, cu, lens, seq, scale, config=config)
            torch.cuda.synchronize()
            row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            row["ms"] = bench(
                lambda c=config: varlen_attention(q, k, v, out, cu, lens, seq, scale, config=c)
            )
        except Exception as error:  # a config that does not compile or fit: record, go on
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
    for row in rows:
        if "ms" in row:
            row["tflops"] = tflops(batch, seq, heads, head_dim, row["ms"])
            row["vs_sdpa"] = sdpa_ms / row["ms"]
    return rows


def describe(config: dict | None) -> str:
    if config is None:
        return "-"
    split = " split" if config.get("split_head_dim") else ""
    return "m{block_m} n{block_n} w{num_warps} s{num_stages}".format(**config) + split


def isolated(case: int, dtype: str) -> list[dict]:
    """Case ``case``'s rows from a process of its own, kernel launches synchronous; if the
    process dies, one row naming the config it was running."""
    done = subprocess.run(
        [sys.executable, __file__, "--case", str(case), "--dtype", dtype],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"},
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    batch, seq, heads, head_dim = CASES[case]
    running = [line for line in done.stderr.splitlines() if line.startswith("running ")]
    last = running[-1].removeprefix("running ") if running else "before any config"
    error = done.stderr.strip().splitlines()[-1:] or ["no output"]
    return [
        dict(
            batch=batch,
            seq=seq,
            heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            impl="triton_varlen",
            config=None,
            error=f"process died (exit {done.returncode}) running {last}: {error[0][:120]}",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dims", help="only the cases of these head dims (e.g. 72,80)")
    parser.add_argument("--isolate", action="store_true", help="each case in its own process")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.case is not None:  # one case, for --isolate: its rows as one JSON line
        print(json.dumps(run_case(*CASES[args.case], dtype)), flush=True)
        return
    wanted = {int(d) for d in args.head_dims.split(",")} if args.head_dims else None
    cases = [i for i, case in enumerate(CASES) if wanted is None or case[3] in wanted]
    if args.isolate:
        rows = [row for i in cases for row in isolated(i, args.dtype)]
    else:
        rows = [row for i in cases for row in run_case(*CASES[i], dtype)]
    print(
        f"{'B':>2} {'S':>5} {'H':>3} {'D':>4}  {'impl':<14} {'config':<20} "
        f"{'ms':>8} {'TFLOP/s':>8} {'vs sdpa':>8} {'rel err':>8}"
    )
    for r in rows:
        mark = "*" if r.get("default") else " "
        head = f"{r['batch']:>2} {r['seq']:>5} {r['heads']:>3} {r['head_dim']:>4}  {r['impl']:<14}"
        if "error" in r:
            print(f"{head} {describe(r['config']):<19}{mark} {r['error'][:60]}")
            continue
        print(
            f"{head} {describe(r['config']):<19}{mark} {r['ms']:>8.4f} {r['tflops']:>8.1f} "
            f"{r['vs_sdpa']:>8.3f} {r['rel_err']:>8.1e}"
        )
    print("* the default config for the head dim")
    if args.json:
        env = dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            python=platform.python_version(),
        )
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, results=rows), f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
