"""Cold and warm start of a packed tower's token budgets, each in a fresh process.

    python3 benchmarks/packed_start.py --tower qwen2.5-vl-7b --json start.json   # an H200
    python3 benchmarks/packed_start.py --tiny --json start.json                  # any machine

A replica of a packed tower (Qwen2.5-VL-7B's, built from its configuration with random weights,
bf16; nothing downloaded) serves the packed towers' benchmark stream
(``benchmarks/packed_towers.py``: requests of 1 to 3 images and short videos) twice, in two
fresh Python processes whose Inductor and Triton caches are empty directories:

- **cold**: ``wrap`` with its defaults; the first calls run eagerly while the planner observes
  them, then the budgets it chose are captured, each measured against eager on its first call;
  at the end the process saves a warm-start file;
- **warm**: ``wrap(..., warm_start=file)``: the budgets are chosen from the calls the cold
  process saw, so the first call captures them, and their measurements are taken from the
  file, as is the Triton attention kernel compiled there.

Each process reports ``wrap_s`` (``wrap`` itself: adapter, plan and the warm-start file read),
``capture_s`` (every capture's cost over the stream: buffers, attention backends timed,
warm-up, capture and measurement; ``stats.capture_seconds``), ``ready_s`` (their sum: what
graphs cost a replica before they serve, the time it observes calls not counted),
``first_call_ms``, the calls served eagerly and the worst error against eager. ``--tiny``
runs a four-layer tower in float32, on the CPU with simulated graphs where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import packed_towers
import qwen_towers
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

RESULT = "packed-start-result: "


def process(tower_name: str, tiny: bool, mode: str, file: str) -> dict[str, Any]:
    """One replica's start and stream (``mode`` is ``cold`` or ``warm``)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    names = [t.name for t in qwen_towers.towers(False)]
    tower = qwen_towers.towers(tiny)[names.index(tower_name)]  # a tiny one stands in with --tiny
    model = qwen_towers.build(tower, dtype, device)
    config = model.config
    sizes = packed_towers.TINY_SIZES if tiny else packed_towers.SIZES
    requests = qwen_towers.stream_requests(config, 100, sizes, seed=0)
    generator = torch.Generator().manual_seed(1)
    inputs = [qwen_towers.pixels_for(model, grids, generator) for grids in requests]
    options: dict[str, Any] = {"adapter": qwen_towers.ADAPTER}
    if device.type != "cuda":
        options["backend"] = SimulatedGraphs()
    if mode == "warm":
        options["warm_start"] = file
    with torch.inference_mode():
        wanted = [qwen_towers.features(model(p, grid_thw=g)) for p, g in inputs]
        started = time.perf_counter()
        graphed = layergraph.wrap(model, **options)
        wrap_s = time.perf_counter() - started
        worst, first_call_ms = 0.0, None
        for (pixels, grid), want in zip(inputs, wanted):
            started = time.perf_counter()
            got = qwen_towers.features(graphed(pixels, grid_thw=grid))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if first_call_ms is None:
                first_call_ms = (time.perf_counter() - started) * 1e3
            worst = max(worst, relative_error(got, want))
        stats = graphed.stats
        if mode == "cold":
            graphed.save_warm_start(file)
    return {
        "process": mode,
        "tower": tower.name,
        "requests": len(requests),
        "tokens": sum(int(grid.prod(-1).sum()) for _, grid in inputs),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "wrap_s": wrap_s,
        "capture_s": stats.capture_seconds,
        "ready_s": wrap_s + stats.capture_seconds,
        "first_call_ms": first_call_ms,
        "captures": stats.captures,
        "graphs": stats.graphs,
        "budgets": list(stats.budgets),
        "replans": stats.replans,
        "eager_calls": dict(stats.eager_calls),
        "worst_error": worst,
        "file_bytes": Path(file).stat().st_size,
    }


def run(tower: str, tiny: bool) -> dict[str, Any]:
    """The cold process, then the warm one, each with empty compiler caches."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="packed-start-") as scratch:
        file = str(Path(scratch) / "warm.lgws")
        for mode in ("cold", "warm"):
            caches = Path(scratch) / mode
            environment = {
                **os.environ,
                "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
                "TRITON_CACHE_DIR": str(caches / "triton"),
            }
            command = [sys.executable, __file__, "--tower", tower, "--process", mode, file]
            done = subprocess.run(
                command + (["--tiny"] if tiny else []),
                capture_output=True,
                text=True,
                env=environment,
                check=False,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"the {mode} process failed:\n{done.stderr[-4000:]}")
            rows[mode] = json.loads(lines[-1].removeprefix(RESULT))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tower", default="qwen2.5-vl-7b", choices=[t.name for t in qwen_towers.towers(False)]
    )
    parser.add_argument("--tiny", action="store_true", help="a four-layer tower in float32")
    parser.add_argument("--json", help="write both processes' numbers here")
    parser.add_argument("--process", nargs=2, metavar=("MODE", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process:
        mode, file = args.process
        print(RESULT + json.dumps(process(args.tower, args.tiny, mode, file)), flush=True)
        return
    rows = run(args.tower, args.tiny)
    for mode, row in rows.items():
        print(
            f"{mode}: ready {row['ready_s']:.2f} s (wrap {row['wrap_s']:.2f}, capture "
            f"{row['capture_s']:.2f}, {row['captures']} captures), first call "
            f"{row['first_call_ms']:.1f} ms, eager calls {sum(row['eager_calls'].values())}, "
            f"budgets {row['budgets']}, worst error {row['worst_error']:.1e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
