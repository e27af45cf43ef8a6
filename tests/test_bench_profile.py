"""``layergraph bench --profile`` on the CPU: a call's operators sorted into kernel classes,
its matrix products' and attention's FLOPs counted, and the report's table of both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from layergraph.bench import BenchReport, run_benchmark
from layergraph.bench.profile import flops_by_kind, host_functions, kernel_class, profile_call

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix products"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "matrix products"),
        ("flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
        ("_varlen_fwd_kernel", "attention"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel", "norms"),
        ("_add_norm_kernel", "norms"),
        ("void at::native::elementwise_kernel<128, 2>", "elementwise"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy", "copies"),
        ("void at::native::reduce_kernel<512, 1>", "reductions"),
        ("aten::addmm", "matrix products"),
        ("aten::native_layer_norm", "norms"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::gelu", "elementwise"),
        ("something_else_entirely", "other"),
    ],
)
def test_kernels_fall_into_classes_by_name(name: str, expected: str) -> None:
    assert kernel_class(name) == expected


class Block(nn.Module):
    """A transformer-like block: norm, attention by SDPA, a matrix product."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, tokens, 3, self.heads, -1).unbind(2)
        attended = nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v))
        )
        return x + self.out(attended.transpose(1, 2).reshape(batch, tokens, width))


def test_a_calls_operators_are_profiled_by_class_and_its_flops_split() -> None:
    block = Block().eval()
    x = torch.randn(2, 32, 64)
    with torch.inference_mode():
        profiled = profile_call(lambda: block(x), device=CPU, calls=3)
        with FlopCounterMode(display=False) as counter:
            block(x)
    names = {entry.name for entry in profiled.classes}
    assert {"matrix products", "attention", "norms"} <= names
    assert profiled.busy_ms == pytest.approx(sum(entry.ms for entry in profiled.classes))
    assert profiled.busy_ms > 0 and profiled.kernels >= 4
    assert [entry.ms for entry in profiled.classes] == sorted(
        (entry.ms for entry in profiled.classes), reverse=True
    )
    assert profiled.ms_of("matrix products") > 0 and profiled.ms_of("no such class") == 0
    matmul, _ = flops_by_kind(counter)
    # qkv and out over 2 x 32 tokens: 2 * tokens * width * (3 + 1) * width
    assert matmul == pytest.approx(2 * 64 * 64 * 64 * 4 / 1e9)


class Counted:
    """What a ``FlopCounterMode`` answers, given its counts."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def get_flop_counts(self) -> dict[str, dict[str, int]]:
        return {"Global": self.counts}


def test_flops_are_split_into_matrix_products_attention_and_the_rest() -> None:
    counted = Counted(
        {
            "aten.addmm": 3_000_000_000,
            "aten.mm.default": 1_000_000_000,
            "aten.convolution": 500_000_000,
            "aten._scaled_dot_product_flash_attention": 2_000_000_000,
            "aten._scaled_dot_product_cudnn_attention": 1_000_000_000,
            "aten.add": 7_000_000,
        }
    )
    assert flops_by_kind(counted) == pytest.approx((4.5, 3.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_the_benchmark_profiles_each_batch_and_reports_the_classes(tmp_path: Path) -> None:
    report = run_benchmark("timm:vit_tiny_patch16_224", [1, 2], iters=1, profile=True)
    for row in report.rows:
        assert row.profile is not None and row.profile["busy_ms"] > 0
        assert 0 < row.matmul_gflop <= row.gflop * 1.001 and row.attention_gflop >= 0
        assert row.floor_ms(None) is None and row.floor_ms(100.0) > 0
    classes = report.profile_classes()
    assert "matrix products" in classes
    for row, profiled in zip(report.profile_rows(), report.rows):
        assert row["batch"] == profiled.batch and len(row["classes"]) == len(classes)
        assert sum(row["classes"]) == pytest.approx(row["busy_ms"])
        assert row["floor_ms"] is None and row["over_floor"] is None  # no matrix rate here
    markdown = report.to_markdown()
    assert "Where the call's time goes" in markdown and "| floor ms |" in markdown
    report.write_json(tmp_path / "r.json")
    assert BenchReport.read_json(tmp_path / "r.json") == report
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["profile"]["classes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_the_bench_command_prints_the_profile() -> None:
    arguments = ["--model", "timm:vit_tiny_patch16_224", "--batch-sizes", "1", "--iters", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "bench", *arguments, "--profile"],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", **__import__("os").environ},
    )
    assert "where each call's time goes" in out.stdout
    assert "matrix products" in out.stdout


def _scaled(values: list[float]) -> list[float]:
    return [value * 2.0 for value in values]


def test_a_calls_host_time_is_found_in_the_functions_it_runs() -> None:
    """The function that does the call's work leads, counted once a call; the profiler's own
    bookkeeping is left out."""
    values = [float(i) for i in range(20_000)]

    def call() -> float:
        return sum(_scaled(values))

    found = host_functions(call, device=CPU, calls=5, top=5)
    assert [f.own_ms for f in found] == sorted((f.own_ms for f in found), reverse=True)
    scaled = next(f for f in found if f.name.endswith("(_scaled)"))
    assert scaled.calls == 1 and scaled.total_ms >= scaled.own_ms > 0
    assert scaled.name.startswith("tests/test_bench_profile.py:")
    assert found[0].own_ms >= scaled.own_ms and len(found) <= 5
    assert not any("_lsprof" in f.name for f in found)
