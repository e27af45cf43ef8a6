"""One speed option off against the defaults, in turns, on one GPU: whether a default pays.

    python3 benchmarks/option_ab.py --option fuse_gelu --models siglip-so400m-384 \
        --batch-sizes 1,32 --towers qwen3-vl-8b,qwen3.5 --sizes 448x448,896x896 \
        [--json results.json]

Each model is built once in bfloat16 with random weights; two copies are wrapped, one with
``OPTION=False`` (or ``--baseline``'s value, e.g. ``--option attention --baseline auto``,
called ``OPTION_off`` in the rows either way) and one with ``wrap``'s defaults (or
``OPTION=VALUE`` with ``--value``, for an option off by default; called ``default`` either
way), and a float32 copy is the reference. Fixed towers (``--models``: ``layergraph bench
--list-models`` names) are timed per batch size, packed towers (``--towers``: the packed
towers benchmark's names) on one image of each size; both wrappers capture first, then are
timed in turns with the eager model (:func:`layergraph.timing.interleaved_waited_ms`, waited
calls, CUDA events). Errors are relative to the float32 reference. ``--profile`` adds each
side's call by kernel class (:func:`layergraph.bench.profile.profile_call`). ``--device cpu`` with
``-tiny`` towers is a smoke run of the script (its calls run eagerly). What this does not
do: time capture, or streams.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import layergraph
from layergraph.bench.examples import example_model
from layergraph.bench.profile import profile_call
from layergraph.timing import interleaved_waited_ms
from layergraph.validation import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qwen_towers


def first(output: Any) -> torch.Tensor:
    """The first tensor of an output: a tensor, a tuple's first, an output object's first."""
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, (tuple, list)) else output.to_tuple()[0]


def compare(
    calls: dict[str, Callable[[], Any]],
    reference: Callable[[], Any],
    read: Callable[[Any], Any],
    device: torch.device,
    profile: bool,
) -> dict[str, Any]:
    """Each call's waited median and error against ``reference``, timed in turns, and with
    ``profile`` its milliseconds by kernel class."""
    with torch.inference_mode():
        want = read(reference()).float()
        errors = {name: relative_error(read(fn()).float(), want) for name, fn in calls.items()}
        times = interleaved_waited_ms(calls, device=device)
        row: dict[str, Any] = {"ms": times, "error_vs_float32": errors}
        if profile:
            row["profile"] = {name: profiled(fn, device) for name, fn in calls.items()}
    return row


def profiled(call: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """``call``'s busy milliseconds, and per kernel class its milliseconds and longest
    kernels."""
    found = profile_call(call, device=device, longest=4)
    return {
        "busy_ms": found.busy_ms,
        "kernels": found.kernels,
        "classes": {
            entry.name: {"ms": entry.ms, "longest": entry.longest} for entry in found.classes
        },
    }


def fixed_rows(
    name: str,
    option: str,
    batches: list[int],
    device: torch.device,
    baseline: dict[str, Any],
    chosen: dict[str, Any],
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Rows of one example model, one per batch size."""
    example = example_model(name)
    model = example.build(torch.bfloat16, device)
    reference = copy.deepcopy(model).float()
    off = layergraph.wrap(copy.deepcopy(model), **baseline)
    default = layergraph.wrap(copy.deepcopy(model), **chosen)
    rows = []
    for batch in batches:
        args, kwargs = example.inputs(batch, torch.bfloat16, device)
        wide = tuple(a.float() if a.is_floating_point() else a for a in args)
        with torch.inference_mode():
            for graphed in (off, default):
                graphed(*args, **kwargs)
        row = compare(
            {
                "eager": functools.partial(model, *args, **kwargs),
                f"{option}_off": functools.partial(off, *args, **kwargs),
                "default": functools.partial(default, *args, **kwargs),
            },
            functools.partial(reference, *wide, **kwargs),
            first,
            device,
            profile,
        )
        row.update(model=name, batch=batch, speed_options=dict(default.speed_options))
        rows.append(row)
        print(summary(row, option, f"b{batch}"), flush=True)
    return rows


def packed_rows(
    name: str,
    option: str,
    sizes: list[tuple[int, int]],
    device: torch.device,
    baseline: dict[str, Any],
    chosen: dict[str, Any],
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Rows of one packed tower, one per image size."""
    tiny = name.endswith("-tiny")
    tower = next(t for t in qwen_towers.towers(tiny=tiny) if t.name == name)
    model = qwen_towers.build(tower, torch.bfloat16, device)
    reference = copy.deepcopy(model).float()
    options = {"adapter": qwen_towers.ADAPTER, "observe_calls": 0}
    off = layergraph.wrap(copy.deepcopy(model), **options, **baseline)
    default = layergraph.wrap(copy.deepcopy(model), **options, **chosen)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for width, height in sizes:
        grid = [qwen_towers.grid_for(model.config, width, height)]
        pixels, grid_thw = qwen_towers.pixels_for(model, grid, generator)
        row = compare(
            {
                "eager": functools.partial(qwen_towers.call, model, pixels, grid_thw),
                f"{option}_off": functools.partial(qwen_towers.call, off, pixels, grid_thw),
                "default": functools.partial(qwen_towers.call, default, pixels, grid_thw),
            },
            functools.partial(qwen_towers.call, reference, pixels.float(), grid_thw),
            qwen_towers.features,
            device,
            profile,
        )
        row.update(
            model=name,
            size=f"{width}x{height}",
            tokens=pixels.shape[0],
            speed_options=dict(default.speed_options),
        )
        rows.append(row)
        print(summary(row, option, f"{width}x{height}"), flush=True)
    return rows


def summary(row: dict[str, Any], option: str, shape: str) -> str:
    ms, errors = row["ms"], row["error_vs_float32"]
    off, default = ms[f"{option}_off"], ms["default"]
    line = (
        f"{row['model']:<20} {shape:>10}  eager {ms['eager']:8.3f}  {option} off {off:8.3f}  "
        f"default {default:8.3f} ms  ({off / default:.3f}x)  errors eager "
        f"{errors['eager']:.2e} off {errors[f'{option}_off']:.2e} default "
        f"{errors['default']:.2e}  [{option}: {row['speed_options'].get(option, '-')}]"
    )
    for name, found in row.get("profile", {}).items():
        classes = ", ".join(f"{c} {v['ms']:.2f}" for c, v in found["classes"].items())
        line += f"\n    {name:<16} busy {found['busy_ms']:7.2f} ms: {classes}"
    return line


def parsed(value: str) -> bool | str:
    """A command line's option value: ``true`` and ``false`` as booleans, others as given."""
    return {"true": True, "false": False}.get(value.lower(), value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", required=True, help="a speed option, e.g. fuse_gelu")
    parser.add_argument("--models", default="", help="comma-separated example model names")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--towers", default="", help="comma-separated packed tower names")
    parser.add_argument("--sizes", default="448x448,896x896")
    parser.add_argument(
        "--value", default=None, help="the option's value on the second side: true or a string"
    )
    parser.add_argument(
        "--baseline", default="false", help="the option's value on the first side (false)"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no graphs)")
    parser.add_argument("--profile", action="store_true", help="each call by kernel class")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    chosen = {} if args.value is None else {args.option: parsed(args.value)}
    baseline = {args.option: parsed(args.baseline)}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    for name in filter(None, args.models.split(",")):
        rows += fixed_rows(name, args.option, batches, device, baseline, chosen, args.profile)
    for name in filter(None, args.towers.split(",")):
        rows += packed_rows(name, args.option, sizes, device, baseline, chosen, args.profile)  # type: ignore[arg-type]
    if args.json:
        record = {
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "-",
            "torch": torch.__version__,
            "command": " ".join(["python3", *sys.argv]),
            "rows": rows,
        }
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
