"""The benchmark's logic on the CPU (eager only there), and its report forms."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from layergraph.bench import BenchReport, BenchRow, run_benchmark


def bench(*arguments: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``layergraph bench ARGUMENTS`` in a fresh interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "bench", *arguments],
        capture_output=True,
        text=True,
        check=check,
    )


TINY_VIT = ("--model", "timm:vit_tiny_patch16_224", "--batch-sizes", "1", "--iters", "1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_run_benchmark_without_gpu_measures_eager_only() -> None:
    seen: list[int] = []
    report = run_benchmark(
        "vit_tiny_patch16_224", [2, 1], iters=2, on_row=lambda r: seen.append(len(r.rows))
    )
    assert [row.batch for row in report.rows] == [1, 2] and seen == [1, 2]
    assert report.adapter == "timm" and report.dtype == "float32"
    first, second = report.rows
    assert first.eager_ms > 0 and first.layergraph_ms is None and first.plain_graph_ms is None
    # vit_tiny: about 1.26 GFLOP per 224x224 image (counted from the model's shapes)
    assert 2.0 < first.gflop < 3.0 and second.gflop == pytest.approx(2 * first.gflop)
    assert report.pool_ratio is None and report.matmul_tflops is None


def test_run_benchmark_counts_flops_where_a_parameter_is_a_module_input() -> None:
    """timm's attention pooling passes its latent query, a parameter, to a linear layer; the
    FLOP count of such a model must work under inference mode and equal a count made
    with gradients off."""
    import timm

    report = run_benchmark("timm:test_vit3", [2], iters=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, report.dtype)
    model = timm.create_model("test_vit3", pretrained=False).to(device, dtype).eval()
    shape = timm.models.get_pretrained_cfg_value("test_vit3", "input_size")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.requires_grad_(False)(torch.randn(2, *shape, device=device, dtype=dtype))
    assert report.rows[0].gflop == pytest.approx(counter.get_total_flops() / 1e9)
    assert report.rows[0].gflop > 0


def sample_report() -> BenchReport:
    report = BenchReport(
        model="m",
        adapter="timm",
        device="GPU",
        dtype="bfloat16",
        versions={"torch": "2"},
        date="today",
        command="layergraph bench",
        iters=10,
        matmul_tflops=800.0,
        capture_seconds=0.5,
        capture_wall_seconds=0.6,
        pool_bytes=210 * 2**20,
        largest_alone_pool_bytes=200 * 2**20,
    )
    report.rows = [
        BenchRow(
            batch=1,
            eager_ms=3.0,
            gflop=35.0,
            layergraph_ms=0.7,
            plain_graph_ms=0.69,
            compile_ms=0.8,
        ),
        BenchRow(batch=8, eager_ms=3.2, gflop=280.0, layergraph_ms=1.12, plain_graph_ms=1.12),
    ]
    return report


def test_markdown_holds_ratios_rates_and_memory() -> None:
    report = sample_report()
    report.rows[0].tuned_ms = 0.6
    text = report.to_markdown()
    assert "(1.050x)" in text and "800 TFLOP/s" in text and "0.50 s" in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[7:10] == ["4.286x", "1.014x", "0.875x"]
    assert cells[10:15] == ["0.870x", "0.750x", "11.7", "50.0", "6 %"]
    row8 = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    assert "| - |" in row8  # no compile measured


def test_markdown_marks_batches_layergraph_served_eagerly() -> None:
    report = sample_report()
    report.rows[0].layergraph_served = "graph"
    report.rows[1].layergraph_served = "eager"
    rows = [line for line in report.to_markdown().splitlines() if line.startswith("| ")]
    assert "| 1.120 (eager) |" in next(row for row in rows if row.startswith("| 8 |"))
    assert "(eager)" not in next(row for row in rows if row.startswith("| 1 |"))
    assert not BenchRow(batch=2, eager_ms=1.0, gflop=1.0).served_eagerly  # not recorded


def test_markdown_shows_latency_with_a_wait_next_to_the_loop() -> None:
    report = sample_report()
    assert "with a wait" not in report.to_markdown()  # none measured (no GPU, older reports)
    report.rows[0].eager_wait_ms = 3.1
    report.rows[0].layergraph_wait_ms = 0.78
    report.rows[0].plain_graph_wait_ms = 0.72
    text = report.to_markdown()
    row = [line for line in text.splitlines() if line.startswith("| 1 |")][-1]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == ["1", "3.100", "0.780", "0.720", "1.083x", "1.014x"]
    assert "One call with a wait for its result" in text


def test_waited_latency_off_the_gpu_is_wall_clock_time() -> None:
    from layergraph.timing import waited_ms

    assert waited_ms(lambda: time.sleep(0.002), device=torch.device("cpu"), iters=5) >= 2.0


def test_json_and_plot_are_written(tmp_path: Path) -> None:
    report = sample_report()
    report.write_json(tmp_path / "r.json")
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["pool_ratio"] == pytest.approx(1.05) and len(record["rows"]) == 2
    report.plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert BenchReport.read_json(tmp_path / "r.json") == report


def test_bench_command_lists_models_and_writes_outputs(tmp_path: Path) -> None:
    listing = bench("--list-models", check=True)
    for name in ("vit_base_patch16_224", "siglip-so400m-384", "internvit-300m", "timm:NAME"):
        assert name in listing.stdout
    if torch.cuda.is_available():
        return
    outputs = ["--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md")]
    out = bench(*TINY_VIT, *outputs, "--plot", str(tmp_path / "b.png"), check=True)
    assert "only the eager path" in out.stdout
    assert "| 1 |" in (tmp_path / "b.md").read_text()
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["batch"] == 1
    assert (tmp_path / "b.png").exists()


def test_unknown_model_name_lists_the_built_in_ones() -> None:
    from layergraph import UnknownAdapterError

    with pytest.raises(UnknownAdapterError, match=r"internvit-300m.*timm:NAME"):
        run_benchmark("no-such-model", [1])


def test_tuned_options_are_recorded_named_and_shown(tmp_path: Path) -> None:
    report = sample_report()
    report.tuned_options = {"compile_region": True, "fuse_qkv": True}
    assert report.labels()["tuned_ms"] == "layergraph, compiled region, fused qkv"
    report.tuned_options["compile_budget"] = 30.0
    assert report.labels()["tuned_ms"].endswith("fused qkv, compile budget 30 s")
    report.tuned_options.pop("compile_budget")
    report.tuned_compile_seconds = 12.34
    markdown = report.to_markdown()
    assert "- tuned: layergraph wrapped with compile_region=True, fuse_qkv=True" in markdown
    assert "- tuned: compiling took 12.3 s in all" in markdown
    report.write_json(tmp_path / "r.json")
    again = BenchReport.read_json(tmp_path / "r.json")
    assert (again.tuned_options, again.tuned_compile_seconds) == (report.tuned_options, 12.34)


def test_reports_written_before_the_tuned_measurement_still_read(tmp_path: Path) -> None:
    report = sample_report()
    report.rows[0].tuned_ms = 0.6
    record = report.to_dict()
    record.pop("tuned_options")
    record["compiled_layers_options"] = {"fuse_qkv": True}
    for row in record["rows"]:
        row["compiled_layers_ms"] = row.pop("tuned_ms")
        row["compiled_layers_error"] = row.pop("tuned_error")
    (tmp_path / "old.json").write_text(json.dumps(record))
    report = BenchReport.read_json(tmp_path / "old.json")
    assert report.tuned_options == {"compile_layers": True, "fuse_qkv": True}
    assert [row.tuned_ms for row in report.rows] == [0.6, None]


def test_compile_layers_and_compile_region_are_refused_together() -> None:
    done = bench("--compile-layers", "--compile-region")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


def test_tuning_flags_become_the_tuned_options(tmp_path: Path) -> None:
    """On the CPU only eager is timed, but the report records what tuned would have used."""
    pytest.importorskip("timm")
    path = tmp_path / "r.json"
    flags = ["--compile-region", "--inductor-option", "coordinate_descent_tuning=True"]
    flags += ["--patch-matmul", "--fuse-gelu", "approximate", "--fuse-norm"]
    flags += ["--compile-budget", "60"]
    done = bench(*TINY_VIT, *flags, "--json", str(path))
    assert done.returncode == 0, done.stderr
    assert BenchReport.read_json(path).tuned_options == {
        "compile_region": {"options": {"coordinate_descent_tuning": True}},
        "patch_matmul": True,
        "fuse_gelu": "approximate",
        "fuse_norm": True,
        "compile_budget": 60.0,
    }
    for wrong, message in (
        (["--fuse-gelu", "exact"], "invalid choice: 'exact'"),
        (["--inductor-option", "a=1"], "--inductor-option and --compile-budget need"),
        (["--compile-budget", "5"], "--inductor-option and --compile-budget need"),
        (["--compile-region", "--inductor-option", "a"], "--inductor-option takes NAME=VALUE"),
    ):
        done = bench(*wrong)
        assert done.returncode == 2 and message in done.stderr


def test_stream_requests_are_drawn_reproducibly_and_bad_specs_named() -> None:
    from layergraph.bench.stream import parse_stream

    requests = parse_stream("120:1-13", seed=3)
    assert len(requests) == 120 and min(requests) >= 1 and max(requests) <= 13
    assert requests == parse_stream("120:1-13", seed=3) != parse_stream("120:1-13", seed=4)
    for bad in ("120", "x:1-2", "5:3-1", "0:1-2"):
        with pytest.raises(ValueError, match="stream"):
            parse_stream(bad)


def test_stream_serves_every_method_and_checks_every_answer() -> None:
    from layergraph.bench.stream import run_stream
    from layergraph.testing import SimulatedGraphs

    report = run_stream("timm:test_vit3", [1, 3, 2, 3, 5], backend=SimulatedGraphs(), passes=3)
    methods = {row.method: row for row in report.rows}
    assert list(methods) == ["eager", "layergraph", "powers of two", "exact keys"]
    assert methods["eager"].graphs is None and len(methods["eager"].steady_passes) == 3
    for row in report.rows:
        assert row.steady_s == sorted(row.steady_passes)[1] > 0
    assert methods["layergraph"].graphs == 4 and methods["layergraph"].padded_calls == 0
    assert methods["powers of two"].graphs == 4  # buckets 1, 2, 4 and 8
    assert methods["powers of two"].padded_calls == 12  # 3, 3 and 5, in each of four passes
    assert methods["exact keys"].graphs == 4 and methods["exact keys"].padded_calls == 0
    assert all(row.worst_error <= 1e-4 for row in report.rows)
    text = report.to_markdown()
    assert "5 requests of 1 to 5 images (14 in all)" in text and "| exact keys |" in text
    assert "the median of 3 passes" in text


def test_stream_takes_at_least_one_steady_pass() -> None:
    from layergraph.bench.stream import run_stream
    from layergraph.testing import SimulatedGraphs

    with pytest.raises(ValueError, match="passes"):
        run_stream("timm:test_vit3", [1], backend=SimulatedGraphs(), passes=0)
    report = run_stream("timm:test_vit3", [2, 1], backend=SimulatedGraphs(), passes=1)
    assert [len(row.steady_passes) for row in report.rows] == [1, 1, 1, 1]


def test_bench_stream_command_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    result = bench("--model", "timm:test_vit3", "--stream", "4:1-3", "--json", str(out))
    assert "requests of" in result.stdout
    assert json.loads(out.read_text())["requests"] and result.returncode == 0
