"""Pixtral-12B's vision tower on the GPU, served per token budget by the pixtral adapter.

Marked ``cuda`` and skipped without a GPU. Random weights, bf16, the configuration
transformers' ``PixtralVisionConfig`` defaults to (Pixtral-12B's: hidden 1024, 24 layers, 16
heads, patch 16, images up to 1024 pixels a side, rope theta 10000). The reference is the
unwrapped tower's own forward on the same inputs (its block-diagonal mask through SDPA).
Tolerance: bf16's :data:`~layergraph.validation.DEFAULT_TOLERANCE` (relative error 2e-2); the
graph computes the patch convolution as a matrix product and attention through a varlen
kernel, which round otherwise than eager's kernels.
"""

from __future__ import annotations

import pytest
import torch
from packed_helpers import skip_unless_served

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

transformers = pytest.importorskip("transformers")

skip_unless_served("pixtral")

pytestmark = pytest.mark.cuda

TOLERANCE = DEFAULT_TOLERANCE[torch.bfloat16]
CALLS = (
    [(1024, 1024)],
    [(512, 768), (256, 256), (1024, 384)],
    [(128, 128)] * 9,  # more images than a budget's first eight slots
    [(768, 512), (512, 768), (256, 1024)],  # the totals of the second call, other grids
)
"""Each call's images, (height, width) in pixels."""


def tower() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.PixtralVisionConfig()
    return transformers.PixtralVisionModel(config).to("cuda", torch.bfloat16).eval()


def inputs(sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The images padded to the largest sides, with random pixels in the padding, as the
    processor's batch; ``image_sizes`` on the device, as VLMs pass it."""
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    return dict(
        pixel_values=torch.randn(len(sizes), 3, height, width, device="cuda").bfloat16(),
        image_sizes=torch.tensor(sizes, device="cuda"),
    )


@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_pixtral_12b_tower_graphs_equal_eager(attention: str) -> None:
    model = tower()
    calls = [inputs(sizes) for sizes in CALLS]
    with torch.inference_mode():
        expected = [model(**call, output_hidden_states=-1) for call in calls]
        graphed = layergraph.wrap(
            model, adapter="pixtral", attention=attention, observe_calls=0, compile_layers=False
        )
        for call, want in zip(calls, expected):
            got = graphed(**call, output_hidden_states=-1)
            assert type(got) is type(want)
            assert got.last_hidden_state.shape == want.last_hidden_state.shape
            assert relative_error(got.last_hidden_state, want.last_hidden_state) <= TOLERANCE
            assert relative_error(got.hidden_states[-1], want.hidden_states[-1]) <= TOLERANCE
    stats = graphed.stats
    assert stats.captures >= 1
    assert stats.eager_total == 0 or stats.slower_graphs, dict(stats.eager_calls)
    if attention == "triton":
        assert set(graphed.plan.attention_by_budget.values()) == {"triton"}
    graphed.unwrap()


def test_mistral3_image_features_read_the_graphs() -> None:
    torch.manual_seed(0)
    text = dict(
        model_type="mistral",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
    )
    config = transformers.Mistral3Config(text_config=text, image_token_index=1000)
    model = transformers.Mistral3ForConditionalGeneration(config)
    model = model.to("cuda", torch.bfloat16).eval()
    call = inputs([(512, 768), (256, 256)])
    with torch.inference_mode():
        want = model.get_image_features(**call).pooler_output
        graphed = layergraph.wrap(
            model, batch_sizes=[2304], compile_layers=False
        )  # 1944 + 324 patches of 14
        got = model.get_image_features(**call).pooler_output
    assert graphed.adapter.name == "pixtral"
    assert [t.shape for t in got] == [t.shape for t in want]
    for part, expected in zip(got, want):
        assert relative_error(part, expected) <= TOLERANCE
    assert graphed.stats.replays == 1, graphed.stats
    graphed.unwrap()
