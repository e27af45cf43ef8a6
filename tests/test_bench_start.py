"""``layergraph bench --start``: cold and warm starts of the speed options, in fresh processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from layergraph.bench import StartReport, StartRow, run_start
from layergraph.cli import main
from layergraph.warm_start import load_warm_start


def test_a_warm_start_finds_every_graph_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both starts on the CPU (float32, simulated graphs), compiling the smallest timm ViT's
    layers; one compile thread, so that no process starts a pool of compile workers."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    seen: list[str] = []
    path = tmp_path / "test_vit.lgws"
    report = run_start(
        "timm:test_vit",
        [2, 1],
        {"compile_layers": True},
        device="cpu",
        file=path,
        on_process=seen.append,
    )
    assert seen == ["cold", "warm"]
    assert (report.model, report.adapter, report.dtype) == ("test_vit", "timm", "float32")
    assert report.graph_backend == "simulated" and report.batch_sizes == [1, 2]
    assert report.options == {"compile_layers": True} and report.device.startswith("CPU")
    assert "torch" in report.versions and "timm" in report.versions
    cold, warm = report.cold, report.warm
    assert (cold.process, warm.process) == ("cold", "warm")
    assert cold.misses >= 1 and cold.hits == 0
    assert warm.hits >= 1 and warm.misses == 0, warm.cache
    for row in (cold, warm):
        assert row.graphs == row.captures == 2
        assert 0 < row.start_s < row.process_s and row.build_s > 0 and row.compile_s > 0
        assert row.compiler_import_s is not None and 0 <= row.compiler_import_s < row.process_s
        assert 0 <= row.worst_error <= 1e-4 and row.warnings == []
        assert set(row.cache) == {
            "fxgraph_cache_hit",
            "fxgraph_cache_miss",
            "fxgraph_cache_bypass",
            "autograd_cache_hit",
            "autograd_cache_miss",
            "autograd_cache_bypass",
        }
    assert cold.file_bytes and path.stat().st_size > cold.file_bytes and cold.save_s is not None
    assert warm.file_bytes is None and warm.save_s is None
    assert load_warm_start(path) is True
    assert report.speedup == pytest.approx(cold.start_s / warm.start_s)
    report.write_json(tmp_path / "start.json")
    record = json.loads((tmp_path / "start.json").read_text())
    assert record["speedup"] == pytest.approx(report.speedup) and record["warm"]["cache"]
    assert StartReport.read_json(tmp_path / "start.json") == report
    assert "| warm |" in report.to_markdown()


def test_without_compiling_there_is_nothing_to_warm_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for options in ({}, {"fuse_qkv": True}, {"compile_region": False}):
        with pytest.raises(ValueError, match="there is nothing to warm-start"):
            run_start("timm:test_vit", [1], options)
    for arguments, message in (
        (["--start", "1,8"], "--start needs --compile-layers or --compile-region"),
        (["--start", "1,8", "--fuse-qkv"], "--start needs --compile-layers or --compile-region"),
        (["--start", "1,x", "--compile-region"], "'1,x': expected comma-separated batch sizes"),
        (["--start", "0", "--compile-region"], "'0': expected comma-separated batch sizes"),
        (
            ["--start", "1", "--compile-region", "--stream", "4:1-3"],
            "--start and --stream are separate runs",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["bench", *arguments])
        assert exited.value.code == 2 and message in capsys.readouterr().err


def sample_report() -> StartReport:
    def row(process: str, start_s: float, hits: int, misses: int) -> StartRow:
        cache = {"fxgraph_cache_hit": hits, "fxgraph_cache_miss": misses}
        return StartRow(
            process=process,
            start_s=start_s,
            build_s=1.5,
            process_s=start_s + 9.0,
            compile_s=start_s - 1.0,
            graphs=2,
            captures=2,
            cache=cache,
            worst_error=1.2e-2,
        )

    cold = row("cold", 80.0, 0, 4)
    cold.save_s, cold.file_bytes = 0.5, 3 * 2**20
    return StartReport(
        model="internvit-300m",
        adapter="internvl",
        device="NVIDIA H200",
        dtype="bfloat16",
        graph_backend="CUDA graphs",
        batch_sizes=[1, 8],
        options={"compile_region": True, "fuse_qkv": True},
        versions={"torch": "2"},
        date="today",
        command="layergraph bench --start 1,8",
        cold=cold,
        warm=row("warm", 2.5, 4, 0),
    )


def test_the_start_command_shows_the_starts_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's wiring, with :func:`run_start` replaced by one that returns a report."""
    calls: list[tuple[Any, ...]] = []

    def fake_run_start(model: str, sizes: list[int], options: dict[str, Any], **_: Any) -> Any:
        calls.append((model, sizes, options))
        return sample_report()

    monkeypatch.setattr("layergraph.bench.start.run_start", fake_run_start)
    monkeypatch.setenv("COLUMNS", "250")
    outputs = ["--json", str(tmp_path / "s.json"), "--markdown", str(tmp_path / "s.md")]
    flags = ["--compile-region", "--fuse-qkv", "--start", "8,1", *outputs]
    assert main(["bench", "--model", "internvit-300m", *flags]) == 0
    assert calls == [("internvit-300m", [8, 1], {"compile_region": True, "fuse_qkv": True})]
    shown = capsys.readouterr().out
    assert "compiled region, fused qkv" in shown and "32.00x" in shown and "3.0 MiB" in shown
    assert StartReport.read_json(tmp_path / "s.json") == sample_report()
    markdown = (tmp_path / "s.md").read_text()
    assert "| cold | 80.00 | 1.00x |" in markdown and "| warm | 2.50 | 32.00x |" in markdown
