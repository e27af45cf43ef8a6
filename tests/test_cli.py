"""The ``layergraph`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "layergraph.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )


def test_adapters_lists_first_party_adapters() -> None:
    result = run_cli("adapters")
    assert result.returncode == 0, result.stderr
    for expected in ("sequential", "timm", "layergraph", "ok"):
        assert expected in result.stdout


def test_help_reads_as_text() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout and "adapters" in result.stdout


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_every_option_has_help(command: str) -> None:
    """Each option line of a command's help is followed by its text (argparse leaves an option
    without ``help`` as a bare line)."""
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("options:")[1].splitlines()
    bare = [
        line.strip()
        for line, after in zip(options, [*options[1:], ""])
        if line.startswith("  -")
        and len(line.split("  ")) <= 2  # no text on the option's own line
        and not after.startswith(" " * 10)  # nor on the next
    ]
    assert bare == []


def test_version_is_the_packages() -> None:
    import layergraph

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"layergraph {layergraph.__version__}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bench", "--model", "no-such-model"), "argument --model: no adapter builds a model"),
        (("bench", "--model", "timm:no_such_vit"), "timm has no model 'no_such_vit'"),
        (("bench", "--model", "open_clip:ViT-Z-99"), "open_clip has no model 'ViT-Z-99'"),
        (("demo", "--model", "no_such_vit"), "layergraph demo: error: argument --model"),
        (("bench", "--batch-sizes", "1,x"), "argument --batch-sizes: '1,x': expected"),
        (("demo", "--batch-sizes", "0"), "argument --batch-sizes: '0': expected"),
        (("bench", "--iters", "0"), "argument --iters: '0': expected a whole number"),
        (("bench", "--stream", "12"), "argument --stream: stream '12': expected COUNT:LOW-HIGH"),
        (("bench", "--start", "1"), "--start needs --compile-layers or --compile-region"),
        (("no-such-command",), "invalid choice: 'no-such-command'"),
    ],
)
def test_usage_errors_exit_2_with_a_message_and_no_traceback(
    args: tuple[str, ...], message: str
) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "usage: layergraph" in result.stderr


def test_a_timm_convnet_runs_through_the_demo() -> None:
    """Every timm model is served: a ResNet's whole forward, keyed by its image size."""
    result = run_cli("demo", "--model", "resnet18", "--batch-sizes", "1", "--iters", "1")
    assert result.returncode == 0, result.stderr
    assert "batch 1: answers as eager" in result.stdout


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the no-GPU path of the demo"
)
def test_demo_without_gpu_says_so_and_runs_eagerly(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    result = run_cli(
        "demo",
        "--model",
        "vit_tiny_patch16_224",
        "--batch-sizes",
        "1,2",
        "--iters",
        "1",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "No CUDA GPU here" in result.stdout
    assert "eager x" in result.stdout and "CUDA is not available" in result.stdout
    assert "batch 1: answers as eager" in result.stdout  # progress, batch by batch
    assert "speedup ┃" not in result.stdout and "layergraph ms ┃" in result.stdout
    assert "there is no speedup to show" in result.stdout
    record = json.loads(out.read_text())
    assert [row["batch"] for row in record["results"]] == [1, 2]
    assert all(row["relative_error"] == 0.0 for row in record["results"])


def test_tables_written_to_a_pipe_are_not_cut_at_80_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rich.console import Console

    from layergraph import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert cli._console(Console).width == cli.PIPED_WIDTH > 80
    monkeypatch.setenv("COLUMNS", "100")
    assert cli._console(Console).width == 100


def test_the_bench_table_keeps_every_value_whole_at_80_columns() -> None:
    """Large values in every column of a GPU run, printed to an 80-column console: each value
    appears on one line, uncut; columns no row has a value in are left out."""
    from rich.console import Console

    from layergraph.bench.command import report_table
    from layergraph.bench.report import BenchReport, BenchRow

    rows = [
        BenchRow(
            batch=batch,
            eager_ms=1200.125 * batch,
            gflop=1.0,
            layergraph_ms=1000.5 * batch,
            plain_graph_ms=1100.25 * batch,
            compile_ms=1150.75 * batch,
            tuned_ms=900.125 * batch,
        )
        for batch in (1, 32)
    ]
    report = BenchReport(
        model="vit-large", adapter="timm", device="NVIDIA H100 80GB HBM3", dtype="bfloat16",
        versions={}, date="2026-12-06", command="layergraph bench", iters=10, rows=rows,
        tuned_options={"compile_region": True, "fuse_qkv": True},
    )  # fmt: skip
    console = Console(width=80, record=True, color_system=None)
    console.print(report_table(report))
    text = console.export_text()
    values = [f"{row.eager_ms:.3f}" for row in rows] + [f"{row.tuned_ms:.3f}" for row in rows]
    assert all(value in text for value in values), text
    assert "…" not in text
    only_eager = BenchReport(**{**report.__dict__, "rows": [BenchRow(1, 5.0, 1.0)]})
    console = Console(width=80, record=True, color_system=None)
    console.print(report_table(only_eager))
    assert "layergraph ms" not in console.export_text()


def test_a_status_is_printed_where_the_output_is_a_pipe() -> None:
    import io

    from rich.console import Console

    from layergraph.progress import status

    piped = io.StringIO()
    with status(Console(file=piped, width=80), "cold start: compiling...") as update:
        update("warm start: from the file...")
    assert piped.getvalue().splitlines() == [
        "cold start: compiling...",
        "warm start: from the file...",
    ]
