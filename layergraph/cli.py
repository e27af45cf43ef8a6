"""The ``layergraph`` command: ``layergraph adapters``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["main"]

_BENCH_MODEL = "vit_base_patch16_224"
"""The model ``layergraph bench`` times unless told another."""
_PREFILL_MODEL = "qwen2.5-vl-3b"
"""The VLM ``layergraph bench --prefill`` times unless told another."""
_TUNING_FLAGS = (
    "compile_layers",
    "compile_region",
    "fuse_qkv",
    "patch_matmul",
    "fuse_gelu",
    "fuse_norm",
    "inductor_option",
)
"""The ``bench`` arguments that ask for the tuned measurement."""
_DTYPES = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="layergraph",
        description="Capture a vision encoder's layers into CUDA graphs: list the adapters, run "
        "the demo, or benchmark a model against eager, a hand-written graph and torch.compile.",
    )
    parser.add_argument("--version", action="version", version=f"layergraph {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "adapters",
        help="list the adapters, the attention backends and any plugin or adapter that failed",
    )
    demo = commands.add_parser("demo", help="graph a timm ViT with random weights and time it")
    demo.add_argument("--model", default="vit_base_patch16_224", help="timm model name")
    demo.add_argument(
        "--batch-sizes",
        default=None,
        type=_batch_sizes,
        help="comma-separated batch sizes to check and time (default: 1,3,8,32 on a GPU, 1,3 "
        "on the CPU; 3 is padded to the captured 4)",
    )
    demo.add_argument(
        "--dtype",
        default="float16",
        choices=sorted(_DTYPES),
        help="the dtype the model runs in on a GPU (default float16; the CPU runs float32)",
    )
    demo.add_argument("--iters", type=_positive, default=None, help="timed calls per measurement")
    demo.add_argument("--json", default=None, help="also write the results to this file")
    bench = commands.add_parser(
        "bench", help="eager, layergraph, a hand-written graph and torch.compile side by side"
    )
    bench.add_argument(
        "--model",
        default=None,
        help="an example model of an adapter (see --list-models), timm:NAME or open_clip:NAME "
        f"(default {_BENCH_MODEL}; with --prefill, {_PREFILL_MODEL})",
    )
    bench.add_argument("--list-models", action="store_true", help="list the model names")
    bench.add_argument(
        "--stream",
        default=None,
        metavar="COUNT:LOW-HIGH",
        help="instead, serve COUNT requests of LOW to HIGH images (uniform) with eager, "
        "layergraph, buckets of powers of two and exact keys (and layergraph tuned, with the "
        "tuning flags), each call waited for (e.g. 120:1-13); for a tower that takes every "
        "image at its own size, images of mixed sizes, eager and then wrapped twice",
    )
    bench.add_argument(
        "--prefill",
        type=_positive,
        default=None,
        metavar="REQUESTS",
        help="instead, time to first token of an example VLM on REQUESTS requests of 1 to 3 "
        "images, eager and wrapped, each prefill waited for (p50 and p90)",
    )
    bench.add_argument(
        "--seed", type=int, default=0, help="the --stream mix's or --prefill stream's seed"
    )
    bench.add_argument(
        "--passes",
        type=int,
        default=5,
        help="--stream: steady passes per method after the first, the methods taking turns",
    )
    bench.add_argument(
        "--start",
        default=None,
        type=_batch_sizes,
        metavar="BATCHES",
        help="instead, time the start of layergraph with the speed options at these batch sizes "
        "(e.g. 1,8) in two fresh processes with empty Inductor caches: cold, which saves a "
        "warm-start file, and warm, which loads it; needs --compile-layers or --compile-region",
    )
    bench.add_argument(
        "--batch-sizes",
        default=[1, 2, 4, 8, 16, 32],
        type=_batch_sizes,
        help="comma-separated batch sizes, each timed with every method (default "
        "1,2,4,8,16,32); for a tower that takes every image at its own size, images per call",
    )
    bench.add_argument(
        "--image-size",
        default=None,
        type=_image_size,
        metavar="HEIGHTxWIDTH",
        help="for a tower that takes every image at its own size (qwen2.5-vl-7b, pixtral-12b, "
        "siglip2-so400m-naflex, ...): images of this many pixels (e.g. 896x896; default 448x448),"
        " a batch size being that many images in one call",
    )
    bench.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(_DTYPES),
        help="the dtype of the timed model on a GPU (default bfloat16; the CPU times float32)",
    )
    bench.add_argument("--iters", type=_positive, default=100, help="timed calls per measurement")
    bench.add_argument(
        "--compile",
        action="store_true",
        help="also torch.compile(mode='reduce-overhead'); compiles each batch size for long",
    )
    compiled = bench.add_mutually_exclusive_group()
    compiled.add_argument(
        "--compile-layers",
        action="store_true",
        help="also layergraph tuned, with its layers compiled (wrap(..., compile_layers=True))",
    )
    compiled.add_argument(
        "--compile-region",
        action="store_true",
        help="also layergraph tuned, with its whole captured region compiled "
        "(wrap(..., compile_region=True))",
    )
    bench.add_argument(
        "--fuse-qkv",
        action="store_true",
        help="also layergraph tuned, with fused q/k/v (InternVL, SigLIP and CLIP towers); "
        "combines with the other tuning flags",
    )
    bench.add_argument(
        "--patch-matmul",
        action="store_true",
        help="also layergraph tuned, with the patch embedding as one matrix product; "
        "combines with the other tuning flags",
    )
    bench.add_argument(
        "--fuse-gelu",
        nargs="?",
        const=True,
        default=False,
        choices=[True, "approximate"],
        metavar="approximate",
        help="also layergraph tuned, with each MLP's GELU in its up-projection's epilogue; "
        "'approximate' takes exact-GELU models too; combines with the other tuning flags",
    )
    bench.add_argument(
        "--fuse-norm",
        action="store_true",
        help="also layergraph tuned, with each layer's residual adds and second norm through "
        "one Triton kernel (InternVL, SigLIP and CLIP towers, timm ViTs; CUDA); combines with "
        "the other tuning flags",
    )
    bench.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cap the tuned measurement's compile time, over all batch sizes "
        "(wrap(..., compile_budget=SECONDS)); needs --compile-layers or --compile-region",
    )
    bench.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an Inductor setting for --compile-layers or --compile-region, such as "
        "coordinate_descent_tuning=True; repeatable",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="also profile layergraph's call at each batch size: time by kernel class against "
        "the floor of its matrix products and attention at the measured matrix rate",
    )
    bench.add_argument("--json", default=None, help="write the report as JSON here")
    bench.add_argument("--markdown", default=None, help="write a Markdown table here")
    bench.add_argument("--plot", default=None, help="write a PNG of latency against batch")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.model is None:
        args.model = _PREFILL_MODEL if args.prefill else _BENCH_MODEL
    if getattr(args, "dtype", None) is not None:
        args.dtype = _DTYPES[args.dtype]  # the torch dtype's name for every spelling
    if args.command in commands.choices:
        parser = commands.choices[args.command]  # usage errors name the subcommand
    if args.command == "bench" and (args.inductor_option or args.compile_budget is not None):
        if not (args.compile_layers or args.compile_region):
            parser.error(
                "--inductor-option and --compile-budget need --compile-layers or --compile-region"
            )
        if any("=" not in option for option in args.inductor_option):
            parser.error("--inductor-option takes NAME=VALUE")
    if args.command == "bench" and args.start is not None:
        if not (args.compile_layers or args.compile_region):
            parser.error(
                "--start needs --compile-layers or --compile-region: a warm start holds what "
                "they compiled, and without compiling there is nothing to warm-start"
            )
        if args.stream is not None:
            parser.error("--start and --stream are separate runs: choose one")
    if (
        args.command == "bench"
        and args.image_size is not None
        and (args.stream is not None or args.start is not None)
    ):
        parser.error("--image-size is for the side-by-side run, not --stream or --start")
    if args.command == "bench" and args.prefill is not None:
        others = [
            flag
            for flag, given in (
                ("--stream", args.stream is not None),
                ("--start", args.start is not None),
                ("--image-size", args.image_size is not None),
                ("--compile", args.compile),
                (
                    "the tuning flags",
                    any(getattr(args, flag) for flag in _TUNING_FLAGS),
                ),
            )
            if given
        ]
        if others:
            parser.error(f"--prefill times the VLM as wrap() serves it: drop {', '.join(others)}")
    if args.command == "bench" and args.stream is not None:
        from .bench.stream import parse_stream

        try:
            parse_stream(args.stream)
        except ValueError as error:
            parser.error(f"argument --stream: {error}")
    if args.command in ("bench", "demo") and not getattr(args, "list_models", False):
        unknown = _unknown_model(args.command, args.model)
        if unknown is not None:
            parser.error(unknown)
        refusal = _unfit_model(args) if args.command == "bench" else None
        if refusal is not None:
            parser.error(refusal)
    try:
        from rich.console import Console
    except ImportError:
        print("the layergraph command needs rich: pip install 'layergraph[cli]'", file=sys.stderr)
        return 2
    console = _console(Console)
    if args.command == "adapters":
        return _adapters(console)
    from .adapter import AdapterMismatch
    from .plugins import UnknownAdapterError

    try:
        if args.command == "bench":
            from .bench.command import bench_command

            return bench_command(console, args)
        return _demo(console, args)
    except (AdapterMismatch, UnknownAdapterError) as refusal:  # the model, not the command
        print(f"layergraph {args.command}: error: {refusal}", file=sys.stderr)
        return 2


def _adapters(console: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from .plugins import get_registry

    registry = get_registry()
    adapters = Table("adapter", "distribution", "version", "status", title="Adapters")
    for info in registry.list():
        if not info.ok:
            status = Text(info.error or "", style="red")
        elif info.note:
            status = Text(f"ok; {info.note}", style="yellow")
        else:
            status = Text("ok", style="green")
        adapters.add_row(info.name, info.distribution, info.version, status)
    backends = Table("backend", "distribution", "version", title="Attention backends")
    for backend in registry.list_attention_backends():
        backends.add_row(backend.name, backend.distribution, backend.version)
    console.print(adapters)
    console.print(backends)
    return 0


def _demo(console: Console, args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from .demo import run_demo

    cuda = torch.cuda.is_available()
    sizes = args.batch_sizes or ([1, 3, 8, 32] if cuda else [1, 3])
    iters = args.iters or (200 if cuda else 5)
    dtype = getattr(torch, args.dtype)
    report = run_demo(args.model, sizes, dtype, iters, console)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    columns = ["batch", "graph vs eager (rel. error)", "eager ms", "layergraph ms"]
    if cuda:
        columns += ["speedup", "hand-written graph ms"]
    table = Table(*columns, title=f"{args.model} on {device}, median of {iters} calls")
    for result in report.results:
        cells = [
            str(result.batch),
            f"{result.relative_error:.2e}",
            f"{result.eager_ms:.3f}",
            f"{result.graphed_ms:.3f}",
        ]
        if cuda:
            plain = "-" if result.plain_graph_ms is None else f"{result.plain_graph_ms:.3f}"
            cells += [f"{result.speedup:.2f}x", plain]
        table.add_row(*cells)
    console.print(table)
    if not cuda:
        console.print(
            "Without a GPU both columns time the same eager computation, so there is no "
            "speedup to show. On a GPU this table adds the speedup and a hand-written CUDA "
            "graph: on an H200, vit_base_patch16_224 at batch 1 runs in 0.69 ms graphed "
            "against 2.6 to 6.5 ms eager (docs/benchmark-runs.md)."
        )
    if args.json:
        record = {
            "model": args.model,
            "device": device,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "iters": iters,
            **report.as_dict(),
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)
    return 0


PIPED_WIDTH = 160
"""The width of the tables when the output is not a terminal and ``COLUMNS`` is unset (rich
would take 80 and cut the tables' columns)."""


def _console(console_class: type[Console]) -> Console:
    """A console for the command's output: the terminal's width, ``COLUMNS`` where set, else
    :data:`PIPED_WIDTH` when the output goes to a file or a pipe."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return console_class()
    return console_class(width=PIPED_WIDTH)


def _unknown_model(command: str, name: str) -> str | None:
    """Why ``name`` is no model ``command`` can build, or ``None`` if it is one."""
    if command != "demo" and name.startswith("open_clip:"):
        try:
            import open_clip
        except ImportError:
            return (
                f"argument --model: {name!r} needs open_clip: pip install 'layergraph[open-clip]'"
            )
        if name.removeprefix("open_clip:") in open_clip.list_models():
            return None
        return (
            f"argument --model: open_clip has no model {name.removeprefix('open_clip:')!r} "
            f"(open_clip.list_models() lists them)"
        )
    if command == "demo" or name.startswith("timm:"):
        try:
            import timm
        except ImportError:
            return f"argument --model: {name!r} needs timm: pip install 'layergraph[demo]'"
        timm_name = name.removeprefix("timm:")
        if timm.is_model(timm_name):
            return None
        return f"argument --model: timm has no model {timm_name!r} (timm.list_models() lists them)"
    from .bench.examples import example_model_names

    names = example_model_names()
    if name in names:
        return None
    return (
        f"argument --model: no adapter builds a model called {name!r}; choose from "
        f"{', '.join(names)}, or timm:NAME (layergraph bench --list-models)"
    )


def _unfit_model(args: argparse.Namespace) -> str | None:
    """Why ``bench``'s ``--model`` cannot be timed the way the other arguments ask (a prefill
    of a model without prompts, an image size for a model of one size, batches of one size
    for a tower of any), or ``None``."""
    asked = (args.prefill, args.image_size, args.stream, args.start)
    if all(value is None for value in asked):
        return None
    from .bench.examples import example_model

    example = example_model(args.model)
    if args.prefill is not None and example.prompt is None:
        return (
            f"argument --prefill: {args.model} is no VLM with example prompts; choose one "
            f"such as {_PREFILL_MODEL}"
        )
    if args.image_size is not None and example.sized_inputs is None:
        return (
            f"argument --image-size: {args.model} takes images of one size; --image-size is "
            "for the towers that take every image at its own size"
        )
    tuned = any(getattr(args, flag) for flag in _TUNING_FLAGS) or args.compile
    if args.stream is not None and example.sized_inputs is not None and tuned:
        return (
            f"argument --stream: a stream of {args.model}'s images of mixed sizes times wrap()'s "
            "defaults: drop --compile and the tuning flags"
        )
    if args.start is not None and example.sized_inputs is not None:
        return (
            f"argument --start: {args.model} takes every image at its own size; --start times "
            "batches of one image size, captured ahead"
        )
    return None


def _positive(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value


def _image_size(text: str) -> tuple[int, int]:
    """An image size in pixels, ``"896x672"`` (height x width), or one side for a square."""
    try:
        sides = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        sides = ()
    if len(sides) == 1:
        sides = sides * 2
    if len(sides) != 2 or min(sides) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected HEIGHTxWIDTH in pixels, e.g. 896x672, or one side, e.g. 448"
        )
    return sides


def _batch_sizes(text: str) -> list[int]:
    """Comma-separated batch sizes (``"1,8"``), each at least 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated batch sizes of at least 1, e.g. 1,8"
        )
    return sizes


if __name__ == "__main__":
    sys.exit(main())
