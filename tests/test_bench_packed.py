"""``layergraph bench`` for the towers that take every image at its own size: their example
models, the inputs made at an image size, and the benchmark's run and report of them."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from layergraph.bench import BenchReport, ExampleModel, run_benchmark
from layergraph.bench.examples import example_model, example_model_names
from layergraph_adapters.example_models.packed import (
    PACKED_EXAMPLES,
    PackedExample,
    packed_example_model,
    pixtral_inputs,
    qwen_inputs,
    siglip2_inputs,
)
from layergraph_adapters.kit.tower_specs import TowerExample, build_tower, transformers_class

CPU = torch.device("cpu")

TINY_QWEN = dict(
    depth=2,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=32,
    window_size=56,
    fullatt_block_indexes=[1],
    spatial_merge_size=2,
    patch_size=14,
    temporal_patch_size=2,
)
TINY_TOWERS: dict[str, PackedExample] = {
    "qwen2_vl": PackedExample(
        "qwen2_vl",
        TowerExample("qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel", TINY_QWEN),
        qwen_inputs,
    ),
    "pixtral": PackedExample(
        "pixtral",
        TowerExample(
            "PixtralVisionModel",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                patch_size=14,
                image_size=280,
            ),
        ),
        pixtral_inputs,
    ),
    "siglip2": PackedExample(
        "siglip2",
        TowerExample(
            "Siglip2VisionModel",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                patch_size=4,
                num_patches=64,
            ),
        ),
        siglip2_inputs,
    ),
}
"""A two-layer tower of each packed adapter's family, as an example."""


def tiny_example(family: str) -> ExampleModel:
    """The example model ``tiny``: a two-layer tower of ``family``."""
    return packed_example_model("tiny", TINY_TOWERS[family])


@pytest.mark.parametrize(
    ("name", "adapter"),
    [
        ("qwen2.5-vl-7b", "qwen2_vl"),
        ("qwen3-vl-8b", "qwen2_vl"),
        ("qwen3.5", "qwen2_vl"),
        ("glm-4.1v-9b", "qwen2_vl"),
        ("pixtral-12b", "pixtral"),
        ("siglip2-so400m-naflex", "siglip2"),
    ],
)
def test_packed_examples_are_listed_and_take_any_image_size(name: str, adapter: str) -> None:
    assert name in example_model_names()
    example = example_model(name)
    assert example.adapter == adapter and example.sized_inputs is not None
    tower = PACKED_EXAMPLES[name].example
    try:
        config = transformers_class(tower.tower).config_class(**tower.settings)
    except (AttributeError, ImportError):
        pytest.skip(f"this transformers has no {tower.tower}")

    def patches(*sizes: tuple[int, int]) -> int:
        return tokens(adapter, config, *example.sized_inputs(sizes, torch.float32, CPU))

    one, other = patches((300, 500)), patches((600, 200))
    assert one > 0 and other > 0 and patches((300, 500), (600, 200), (300, 500)) == 2 * one + other
    assert tokens(adapter, config, *example.inputs(3, torch.float32, CPU)) == 3 * patches(
        (448, 448)
    )


def tokens(adapter: str, config: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The patches a call of a tower of ``adapter``'s family holds, read from its inputs."""
    if adapter == "qwen2_vl":
        return int(kwargs["grid_thw"].prod(dim=1).sum())
    if adapter == "pixtral":
        return int((kwargs["image_sizes"] // config.patch_size).prod(dim=1).sum())
    return int(kwargs["pixel_attention_mask"].sum())


@pytest.mark.parametrize(
    ("size", "grid"),
    [((448, 448), (32, 32)), ((100, 150), (8, 10)), ((10, 2000), (2, 142))],
)
def test_qwen_inputs_round_each_side_to_patch_times_merge(
    size: tuple[int, int], grid: tuple[int, int]
) -> None:
    config = transformers_class(TINY_TOWERS["qwen2_vl"].example.tower).config_class(**TINY_QWEN)
    (pixels,), kwargs = qwen_inputs(config, [size, size], torch.float16, CPU)
    assert kwargs["grid_thw"].tolist() == [[1, *grid]] * 2
    assert pixels.shape == (2 * math.prod(grid), 3 * 2 * 14 * 14)
    assert pixels.dtype == torch.float16


def test_pixtral_inputs_fit_the_largest_side_and_pad_to_the_batch() -> None:
    config = transformers_class("PixtralVisionModel").config_class(image_size=1024, patch_size=16)
    (pixels,), kwargs = pixtral_inputs(config, [(100, 1500), (40, 50)], torch.float32, CPU)
    # 1500 pixels wide is scaled to 1024: 100 * 1024 / 1500 = 68 rows, rounded up to 80
    assert kwargs["image_sizes"].tolist() == [[80, 1024], [48, 64]]
    assert pixels.shape == (2, 3, 80, 1024)


def test_siglip2_inputs_keep_each_image_within_the_patch_budget() -> None:
    settings = TINY_TOWERS["siglip2"].example.settings
    config = transformers_class("Siglip2VisionModel").config_class(**settings)
    (pixels,), kwargs = siglip2_inputs(config, [(64, 64), (16, 400)], torch.float32, CPU)
    grids = kwargs["spatial_shapes"].tolist()
    mask = kwargs["pixel_attention_mask"]
    assert pixels.shape == (2, 64, 3 * 4 * 4) and mask.shape == (2, 64)
    for row, (rows, columns) in enumerate(grids):
        assert 0 < rows * columns <= 64 and int(mask[row].sum()) == rows * columns
        assert not pixels[row, rows * columns :].any()  # padding patches are zero
    assert grids[1][1] > grids[1][0]  # a wide image stays wide


@pytest.mark.parametrize("family", sorted(TINY_TOWERS))
def test_example_inputs_are_what_each_tower_takes(family: str) -> None:
    tiny = TINY_TOWERS[family]
    example = tiny.example
    tower = build_tower(example.tower, example.settings, torch.float32, CPU)
    config = transformers_class(example.tower).config_class(**example.settings)
    args, kwargs = tiny.inputs(config, [(56, 84), (112, 56)], torch.float32, CPU)
    with torch.inference_mode():
        output = tower(*args, **kwargs)
    assert torch.isfinite(output.last_hidden_state).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_run_benchmark_feeds_a_packed_tower_images_of_the_size_asked(tmp_path: Path) -> None:
    tiny = tiny_example("qwen2_vl")
    small = run_benchmark(tiny, [1], iters=1, image_size=(56, 56))
    report = run_benchmark(tiny, [2, 1], iters=1, image_size=(112, 168), profile=True)
    assert report.image_size == (112, 168) and report.adapter == "qwen2_vl"
    one, two = report.rows
    # 112x168 is 8x12 patches, 56x56 is 4x4: six times the tokens, and the FLOPs beside
    assert one.gflop > 5 * small.rows[0].gflop
    assert two.gflop == pytest.approx(2 * one.gflop, rel=0.05)
    assert one.profile is not None and one.profile["busy_ms"] > 0
    assert "images of 112x168 pixels" in report.to_markdown()
    report.write_json(tmp_path / "r.json")
    assert BenchReport.read_json(tmp_path / "r.json") == report


def test_an_image_size_is_refused_for_a_model_of_one_size() -> None:
    with pytest.raises(ValueError, match="vit_tiny_patch16_224 takes images of one size"):
        run_benchmark("vit_tiny_patch16_224", [1], image_size=(448, 448))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model", "vit_base_patch16_224", "--image-size", "448"], "takes images of one size"),
        (["--model", "qwen2.5-vl-7b", "--image-size", "4x"], "expected HEIGHTxWIDTH"),
        (["--model", "qwen2.5-vl-7b", "--image-size", "0x448"], "expected HEIGHTxWIDTH"),
        (
            ["--model", "qwen2.5-vl-7b", "--image-size", "448", "--stream", "4:1-2"],
            "not --stream or --start",
        ),
    ],
)
def test_bench_command_names_a_bad_image_size(arguments: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "bench", *arguments],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and message in run.stderr


@pytest.mark.cuda
def test_run_benchmark_times_a_packed_tower_graphed_against_eager() -> None:
    """The full-size Qwen2.5-VL-7B tower in bf16: layergraph (with its speed options) and eager
    each land about 2e-2 from a float32 copy over 32 layers, so the two may be up to 4e-2
    apart."""
    report = run_benchmark("qwen2.5-vl-7b", [1, 2], iters=5, image_size=(224, 336), profile=True)
    assert report.dtype == "bfloat16" and report.notes
    for row in report.rows:
        assert row.layergraph_ms is not None and row.layergraph_wait_ms is not None
        assert row.plain_graph_ms is None and row.compile_ms is None
        assert row.relative_error is not None and row.relative_error < 4e-2
        assert row.profile is not None and row.profile["busy_ms"] > 0
    assert report.capture_seconds is not None and report.capture_seconds > 0
    assert report.pool_bytes and report.largest_alone_pool_bytes is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--start", "1", "--compile-layers"], "--start times batches of one image size"),
        (["--stream", "4:1-2", "--fuse-qkv"], "drop --compile and the tuning flags"),
    ],
)
def test_what_a_tower_of_any_size_cannot_take_is_refused(flags: list[str], message: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "layergraph.cli", "bench", "--model", "pixtral-12b", *flags],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and message in run.stderr


def test_the_stream_and_start_runs_refuse_a_tower_of_any_size() -> None:
    from layergraph.bench import run_start, run_stream

    with pytest.raises(ValueError, match="pixtral-12b takes every image at its own size"):
        run_stream("pixtral-12b", [1, 2])
    with pytest.raises(ValueError, match="pixtral-12b takes every image at its own size"):
        run_start("pixtral-12b", [1], {"compile_layers": True})


@pytest.mark.parametrize("family", sorted(TINY_TOWERS))
def test_a_stream_of_mixed_sizes_is_served_eagerly_then_from_graphs(family: str) -> None:
    """Ten requests of 1 to 3 images of five sizes, twice through the wrapper after eager: the
    wrapper observes four calls, then graphs serve; on the CPU in float32 with simulated
    graphs the answers equal eager's to float32 rounding."""
    from layergraph.bench.requests import run_image_stream

    model = tiny_example(family)
    sizes = ((56, 56), (56, 112), (112, 84), (84, 168), (28, 224))
    counts = [1, 3, 2, 1, 2, 3, 1, 1, 2, 3]
    report = run_image_stream(model, counts, sizes=sizes, observe_calls=4)
    assert report.kind == "images" and report.requests == 10 and report.images == sum(counts)
    assert list(report.passes) == ["eager", "layergraph_first_pass", "layergraph"]
    for name, part in report.passes.items():
        assert 0 < part.p50_ms <= part.p90_ms and part.error <= 1e-5, name
    observed = {reason: n for reason, n in report.eager_calls.items() if "observing" in reason}
    assert sum(observed.values()) == 4 and report.graphs >= 1
    assert "Time per request, eager over layergraph" in report.to_markdown()


def test_a_stream_of_mixed_sizes_is_refused_for_a_model_of_one_size() -> None:
    from layergraph.bench.requests import run_image_stream

    with pytest.raises(ValueError, match="vit_tiny_patch16_224 takes images of one size"):
        run_image_stream("vit_tiny_patch16_224", [1])


@pytest.mark.cuda
def test_a_stream_of_mixed_sizes_through_a_full_size_tower_on_a_gpu() -> None:
    from layergraph.bench.requests import run_image_stream

    report = run_image_stream("qwen3-vl-8b", [1, 2, 3, 1, 2, 3, 1, 2], observe_calls=2)
    assert report.graphs_kind == "cuda" and report.graphs >= 1
    assert report.passes["layergraph"].error <= 5e-2
    assert report.speedup("p50_ms") is not None
