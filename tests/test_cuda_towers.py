"""SigLIP so400m/14@384, CLIP ViT-L/14@336 with layer -2, and a timm EVA02 on the GPU.

Marked ``cuda`` and skipped without a GPU. Random weights, bf16. The reference is the
unmodified model, computed before wrapping. Tolerance: the graph replays the kernels eager
launches, so bf16's :data:`~layergraph.validation.DEFAULT_TOLERANCE` (relative error 2e-2) is
ample; a padded batch (3 on the graph of 4) may pick other matrix kernels.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from layergraph_adapters.example_models.towers import tower_example  # noqa: E402

pytestmark = pytest.mark.cuda

TOLERANCE = DEFAULT_TOLERANCE[torch.bfloat16]
BATCHES = (1, 3, 8)


def pixels(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, device="cuda", dtype=torch.bfloat16)


def test_siglip_so400m() -> None:
    torch.manual_seed(0)
    model = tower_example("siglip-so400m-384").build(torch.bfloat16, "cuda")
    inputs = [pixels(batch, 384) for batch in BATCHES]
    with torch.inference_mode():
        expected = [model(pixel_values=x) for x in inputs]
        graphed = layergraph.wrap(model, batch_sizes=[1, 4, 8], compile_layers=False)
        for x, want in zip(inputs, expected):
            got = graphed(pixel_values=x)
            assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
            assert relative_error(got.pooler_output, want.pooler_output) <= TOLERANCE
    assert graphed.adapter.name == "siglip"
    assert [str(key.sequence) for key in graphed.keys] == ["729 tokens (384x384)"] * 3
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0


def test_clip_vit_l_336_layer_minus_two() -> None:
    torch.manual_seed(0)
    model = tower_example("clip-vit-l-336").build(torch.bfloat16, "cuda")
    inputs = [pixels(batch, 336) for batch in BATCHES]
    with torch.inference_mode():
        expected = [
            model(pixel_values=x, output_hidden_states=True).hidden_states[-2] for x in inputs
        ]
        graphed = layergraph.wrap(
            model, adapter="clip", feature_layers=-2, batch_sizes=[1, 4, 8], compile_layers=False
        )
        for x, want in zip(inputs, expected):
            got = graphed(pixel_values=x, output_hidden_states=True)
            assert relative_error(got.hidden_states[-2], want) <= TOLERANCE
        assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
        # The last layer, which the graph left out, runs when its output is read.
        with graphed.original() as original:
            last = original(pixel_values=inputs[-1]).last_hidden_state
        assert relative_error(got.last_hidden_state, last) <= TOLERANCE
    assert graphed.plan.feature_layers == (23,)
    assert [str(key.sequence) for key in graphed.keys] == ["577 tokens (336x336)"] * 3


def test_timm_eva02() -> None:
    torch.manual_seed(0)
    model = (
        timm.create_model("eva02_base_patch14_224", pretrained=False)
        .cuda()
        .to(torch.bfloat16)
        .eval()
    )
    inputs = [pixels(batch, 224) for batch in BATCHES]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
        graphed = layergraph.wrap(model, batch_sizes=[1, 4, 8], compile_layers=False)
        for x, want in zip(inputs, expected):
            assert relative_error(graphed(x), want) <= TOLERANCE
    assert graphed.adapter.name == "timm"
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0


def beside(disturb: str) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/compile_coexistence.py with ``disturb`` for SigLIP in a child process.

    A child process, since a memory fault there would leave this process's CUDA context
    unusable for the tests after it.
    """
    script = Path(__file__).parents[1] / "benchmarks" / "compile_coexistence.py"
    command = [sys.executable, str(script), "--model", "siglip-so400m-384", "--disturb", disturb]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("disturb", ["foreign-graph", "other-model"])
def test_graphs_stay_right_beside_other_graphs_released(disturb: str) -> None:
    """A hand-written graph or another wrapped model, captured first and released after
    layergraph's captures, takes no memory that layergraph's graphs still use."""
    done = beside(disturb)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]


def test_graphs_stay_right_beside_torch_compile_reduce_overhead() -> None:
    """torch.compile's own CUDA graphs of the same model leave layergraph's intact."""
    done = beside("compile")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
