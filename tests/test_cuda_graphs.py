"""Real CUDA graphs: graph equals eager, shared pool memory, stable buffers, streams.

Marked ``cuda`` and skipped without a GPU. Tolerance: the graph replays the kernels eager
launches, so at a captured batch size outputs agree to the last bit in practice; a padded batch
gives the matrix products more rows and may pick other kernels, so we accept the relative error
of :data:`layergraph.validation.DEFAULT_TOLERANCE` (5e-3 in fp16, 2e-2 in bf16).
"""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.compiling import CompileBudgetSpent
from layergraph.sequential import CHECKING_REASON
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

timm = pytest.importorskip("timm")

pytestmark = pytest.mark.cuda

POOL_SIZES = (1, 2, 4, 8, 16, 32)


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False).cuda().to(dtype).eval()


def images(batch: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_base_patch16_224"])
def test_graph_equals_eager(name: str, dtype: torch.dtype) -> None:
    model = build(name, dtype)
    graphed = layergraph.wrap(model, adapter="timm", batch_sizes=[1, 4, 8], compile_layers=False)
    with torch.inference_mode():
        for batch in (1, 3, 8):
            for _ in range(2):
                x = images(batch, dtype)
                error = relative_error(graphed(x), model(x))
                assert error <= DEFAULT_TOLERANCE[dtype], (batch, error)
    stats = graphed.stats
    assert stats.graphs == 3 and stats.replays == 6 and stats.padded_calls == 2
    assert stats.eager_total == 0


@pytest.mark.parametrize(
    ("name", "overrides", "size"),
    [
        ("vit_small_patch14_reg4_dinov2", {}, (518, 518)),
        ("vit_base_patch16_siglip_224", {}, (224, 224)),
        ("deit_small_distilled_patch16_224", {}, (224, 224)),
        ("vit_small_patch16_224", {"class_token": False, "global_pool": "avg"}, (224, 224)),
        ("vit_small_patch16_224", {"dynamic_img_size": True}, (160, 288)),
    ],
    ids=["register-tokens", "siglip", "deit-distilled", "no-class-token", "dynamic-size"],
)
def test_vision_transformer_variants(name: str, overrides: dict, size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **overrides).cuda().half().eval()
    graphed = layergraph.wrap(model, adapter="timm", batch_sizes=[1, 4], compile_layers=False)
    with torch.inference_mode():
        for batch in (1, 3):
            x = torch.randn(batch, 3, *size, device="cuda", dtype=torch.float16)
            assert relative_error(graphed(x), model(x)) <= DEFAULT_TOLERANCE[torch.float16]
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0


def test_validate_accepts_a_correct_graph() -> None:
    model = build("vit_tiny_patch16_224", torch.float16)
    graphed = layergraph.wrap(model, adapter="timm", validate=True, compile_layers=False)
    with torch.inference_mode():
        graphed(images(3, torch.float16))
    assert graphed.stats.replays == 1


def pool_bytes(model: torch.nn.Module, sizes: tuple[int, ...]) -> int:
    graphed = layergraph.wrap(model, adapter="timm", batch_sizes=sizes, compile_layers=False)
    with torch.inference_mode():
        graphed.capture(images(1, torch.float16), progress=False)
    size = graphed.stats.pool_bytes
    graphed.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return size


def test_shared_pool_costs_about_the_largest_graph_alone() -> None:
    """A first, released capture takes the process's one-time allocations (cuBLAS workspaces
    land in the pool of the first capture), so that neither measured pool is charged for them."""
    model = build("vit_base_patch16_224", torch.float16)
    pool_bytes(model, (1,))
    all_sizes = pool_bytes(model, POOL_SIZES)
    largest_alone = pool_bytes(model, (max(POOL_SIZES),))
    assert largest_alone > 0
    assert all_sizes <= 1.2 * largest_alone, (all_sizes, largest_alone)


def test_replay_after_the_callers_input_was_freed_and_reused() -> None:
    model = build("vit_tiny_patch16_224", torch.float16)
    graphed = layergraph.wrap(model, adapter="timm", batch_sizes=[4], compile_layers=False)
    with torch.inference_mode():
        first = images(4, torch.float16)
        graphed(first)
        del first
        junk = torch.full((4, 3, 224, 224), 1e4, device="cuda", dtype=torch.float16)
        x = images(4, torch.float16)
        out = graphed(x)
        assert relative_error(out, model(x)) <= DEFAULT_TOLERANCE[torch.float16]
        del junk


def test_static_buffers_keep_their_addresses_across_replays() -> None:
    model = build("vit_tiny_patch16_224", torch.float16)
    graphed = layergraph.wrap(
        model, adapter="timm", batch_sizes=[2], static_output=True, compile_layers=False
    )
    with torch.inference_mode():
        a = graphed(images(2, torch.float16))
        address = a.data_ptr()
        (entry,) = graphed.graphs
        input_address = entry.buffers.inputs[0].data_ptr()
        for _ in range(3):
            x = images(2, torch.float16)
            out = graphed(x)
            assert out.data_ptr() == address
            assert entry.buffers.inputs[0].data_ptr() == input_address
            assert relative_error(out, model(x)) <= DEFAULT_TOLERANCE[torch.float16]


def test_call_on_another_stream_replays_on_that_stream() -> None:
    model = build("vit_tiny_patch16_224", torch.float16)
    graphed = layergraph.wrap(model, adapter="timm", batch_sizes=[2], compile_layers=False)
    side = torch.cuda.Stream()
    with torch.inference_mode():
        graphed(images(2, torch.float16))
        x = images(2, torch.float16)
        expected = model(x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = graphed(x)
        torch.cuda.current_stream().wait_stream(side)
        assert relative_error(out, expected) <= DEFAULT_TOLERANCE[torch.float16]


def test_generic_adapter_graphs_a_module_list_on_gpu() -> None:
    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Encoder().cuda().half().eval()
    graphed = layergraph.wrap(model, adapter="sequential", stack="layers", compile_layers=False)
    with torch.inference_mode():
        graphed(torch.randn(2, 10, 64, device="cuda", dtype=torch.float16))  # checks the list
        graphed.release()
        for batch in (1, 3):
            x = torch.randn(batch, 10, 64, device="cuda", dtype=torch.float16)
            assert relative_error(graphed(x), model(x)) <= DEFAULT_TOLERANCE[torch.float16]
    stats = graphed.stats
    assert stats.replays == 2 and stats.eager_calls == {CHECKING_REASON: 1}


def test_compiled_layers_inside_the_graph_equal_eager() -> None:
    model = build("vit_base_patch16_224", torch.bfloat16)
    inputs = {batch: images(batch, torch.bfloat16) for batch in (1, 3)}
    with torch.inference_mode():
        expected = {batch: model(x) for batch, x in inputs.items()}
        graphed = layergraph.wrap(model, batch_sizes=[1, 4], compile_layers=True)
        for batch, x in inputs.items():
            assert relative_error(graphed(x), expected[batch]) <= DEFAULT_TOLERANCE[torch.bfloat16]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            graphed(inputs[1])
            torch.cuda.synchronize()
    assert any(event.key.startswith("triton_") for event in profile.key_averages())
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    graphed.unwrap()
    assert model.blocks[0]._compiled_call_impl is None


def test_compiled_layers_serve_every_batch_size_with_one_version() -> None:
    """Dynamic shapes on a GPU: batches 2, 3, 5 and 8 captured from one compiled version of the
    layers (one more for the inference tensors of the eager calls each capture is measured
    against), each replay equal to eager."""
    from torch._dynamo.utils import counters

    model = build("vit_base_patch16_224", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    graphed = layergraph.wrap(model, compile_layers=True)
    with torch.inference_mode():
        for batch in (2, 3, 5, 8):
            x = images(batch, torch.bfloat16)
            with graphed.original() as original:
                expected = original(x)
            assert relative_error(graphed(x), expected) <= DEFAULT_TOLERANCE[torch.bfloat16]
    assert graphed.stats.graphs == 4 and graphed.stats.replays == 4
    assert counters["stats"]["unique_graphs"] <= 2
    graphed.unwrap()


@pytest.mark.parametrize("background", [False, True])
def test_the_default_serves_at_once_then_keeps_the_faster_of_two_graphs_per_key(
    background: bool,
) -> None:
    """``compile_layers="auto"`` (the default) on a GPU with Inductor: the first call is
    served by the graph as built; the layers compile ahead (``capture``) or, asked for, in the
    background; then each key is captured again with compiled layers, both replays measured,
    the faster kept; a new size takes the compiled code without compiling; every answer equal
    to eager."""
    from torch._dynamo.utils import counters

    model = build("vit_base_patch16_224", torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    graphed = layergraph.wrap(model, compile_layers={"auto": True, "background": background})
    tolerance = DEFAULT_TOLERANCE[torch.bfloat16]

    def check(batch: int) -> None:
        x = images(batch, torch.bfloat16)
        with graphed.original() as original:
            expected = original(x)
        assert relative_error(graphed(x), expected) <= tolerance, batch

    with torch.inference_mode():
        check(4)
        if background:
            assert "compiling in the background" in graphed.stats.fusion[4].reason
            assert graphed.finish_compiling(timeout=400)
            check(4)
        else:
            assert "not compiled for this size yet" in graphed.stats.fusion[4].reason
            graphed.capture(images(4, torch.bfloat16), progress=False)
        choice = graphed.stats.fusion[4]
        assert choice.plain_ms and choice.compiled_ms, choice
        assert choice.compiled == (choice.compiled_ms < 0.97 * choice.plain_ms)
        versions = counters["stats"]["unique_graphs"]
        check(2)
        check(4)
    assert graphed.stats.fusion[2].compiled_ms is not None  # decided in its first call
    assert counters["stats"]["unique_graphs"] == versions
    print(graphed.stats)
    graphed.unwrap()


def test_flops_on_a_gpu_are_the_cpus_and_the_rate_is_under_the_peak() -> None:
    """The FLOPs counted at capture on a GPU (its attention's kernel, its dtype) equal those
    counted on the CPU, and the replay's rate is under what the card's products reach."""
    from layergraph.flops import count_flops
    from layergraph.timing import matmul_peak_tflops

    model = build("vit_base_patch16_224", torch.bfloat16)
    graphed = layergraph.wrap(model, compile_layers=False)
    with torch.inference_mode():
        graphed(images(4, torch.bfloat16))
        on_cpu = build("vit_base_patch16_224", torch.float32).cpu()
        expected = count_flops(lambda: on_cpu(torch.randn(4, 3, 224, 224)))
    stats = graphed.stats
    assert stats.graphs == 1 and stats.flops == {4: expected}
    assert expected == pytest.approx(4 * 35.1e9, rel=0.02)  # ViT-B/16: 17.6 GMACs an image
    peak = matmul_peak_tflops(torch.device("cuda"))
    assert 0 < stats.achieved_tflops[4] < peak


def test_compiled_region_inside_the_graph_equals_eager() -> None:
    model = build("vit_base_patch16_224", torch.bfloat16)
    inputs = {batch: images(batch, torch.bfloat16) for batch in (1, 3)}
    torch._dynamo.reset()
    with torch.inference_mode():
        expected = {batch: model(x) for batch, x in inputs.items()}
        graphed = layergraph.wrap(model, batch_sizes=[1, 4], compile_region=True)
        for batch, x in inputs.items():
            assert relative_error(graphed(x), expected[batch]) <= DEFAULT_TOLERANCE[torch.bfloat16]
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0


def test_spent_compile_budget_captures_the_rest_uncompiled() -> None:
    """The first size compiled spends the budget; the next is captured uncompiled, and both
    graphs equal eager. The compiled graph runs Inductor's kernels, the other eager's."""
    model = build("vit_base_patch16_224", torch.bfloat16)
    x = images(4, torch.bfloat16)
    torch._dynamo.reset()
    with torch.inference_mode(), pytest.warns(CompileBudgetSpent, match="budget of 1e-09 s"):
        expected = model(x)
        graphed = layergraph.wrap(
            model, batch_sizes=[2, 4], compile_region=True, compile_budget=1e-9
        )
        graphed.capture(x, progress=False)
        for batch in (4, 2):
            assert (
                relative_error(graphed(x[:batch]), expected[:batch])
                <= DEFAULT_TOLERANCE[torch.bfloat16]
            )
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ) as profile:
                graphed(x[:batch])
                torch.cuda.synchronize()
            names = {event.key for event in profile.key_averages()}
            assert any(name.startswith("triton_") for name in names) == (batch == 4)
    assert graphed.compile_budget.exhausted and graphed.compile_budget.spent > 0
