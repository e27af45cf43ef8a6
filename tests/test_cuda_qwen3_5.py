"""Qwen3.5's vision towers on the GPU, served per token budget by the qwen2_vl adapter.

Marked ``cuda`` and skipped without a GPU. Two kinds of test:

- the tower at the configuration transformers' ``Qwen3_5VisionConfig`` defaults to (27 layers
  of 1152, 16 heads, patch 16, merge 2, a 48x48 position table, 3584 out), random weights,
  bf16: the graphs and the tower's own forward each against a float32 copy of the same
  weights, the graphs' error at most bf16's tolerance (2e-2) or 1.25 times eager's own,
  whichever is larger (a 27-layer tower in bf16 is itself near 2e-2 from float32);
- the tiny VLMs of :mod:`test_qwen3_5_adapter` in float32 with TF32 off: image features,
  logits and ``generate()`` through the graphs equal to the unwrapped model's (1e-4 relative
  error; the same tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch
from packed_helpers import skip_unless_served

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

transformers = pytest.importorskip("transformers")

skip_unless_served("qwen3.5 vision")

from test_qwen3_5_adapter import VLMS, call, vlm  # noqa: E402

pytestmark = pytest.mark.cuda

TOLERANCE = 1e-4
CALLS = (
    [(1, 32, 32)],
    [(1, 16, 24), (1, 48, 32), (2, 8, 8)],  # 2048 tokens with a video of two frames
    [(1, 24, 16), (1, 16, 16)],
)
"""Each call's entries, (t, h, w) in patches of 16 pixels."""


@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_qwen3_5_default_tower_graphs_equal_eager_in_bf16(attention: str) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3_5VisionConfig()
    with torch.device("cuda"):
        model = transformers.Qwen3_5VisionModel(config).to(torch.bfloat16).eval()
    features = config.in_channels * config.temporal_patch_size * config.patch_size**2
    inputs = []
    for grids in CALLS:
        grid = torch.tensor(grids, device="cuda")
        tokens = int(grid.prod(-1).sum())
        inputs.append((torch.randn(tokens, features, device="cuda").bfloat16(), grid))
    tolerance = DEFAULT_TOLERANCE[torch.bfloat16]
    reference = copy.deepcopy(model).float()
    with torch.inference_mode():
        exact = [reference(p.float(), grid_thw=g).pooler_output for p, g in inputs]
        expected = [model(pixels, grid_thw=grid).pooler_output for pixels, grid in inputs]
        del reference
        graphed = layergraph.wrap(
            model,
            adapter="qwen2_vl",
            attention=attention,
            batch_sizes=[1024, 2048],
            compile_layers=False,
        )
        for (pixels, grid), want, truth in zip(inputs, expected, exact):
            got = graphed(pixels, grid_thw=grid)
            assert type(got).__name__ == "BaseModelOutputWithPooling"
            assert got.pooler_output.shape == want.shape
            bound = max(tolerance, 1.25 * relative_error(want.float(), truth))
            assert relative_error(got.pooler_output.float(), truth) <= bound
    stats = graphed.stats
    assert stats.replays > 0
    assert stats.eager_total == 0 or stats.slower_graphs, dict(stats.eager_calls)
    if attention == "triton":
        assert set(graphed.plan.attention_by_budget.values()) == {"full: triton"}
    graphed.unwrap()


@pytest.mark.parametrize("name", sorted(VLMS))
@pytest.mark.usefixtures("float32_without_tf32")
def test_the_vlm_image_features_and_generate_read_the_graphs(name: str) -> None:
    model = vlm(name).cuda()
    pixels, grid = call([(1, 4, 6), (1, 2, 2)])  # 6 and 1 merged tokens
    prompt = torch.tensor([[2, 122, *[120] * 6, 123, 3, 122, 120, 123, 4]])
    inputs = dict(
        input_ids=prompt.cuda(),
        pixel_values=pixels.cuda(),
        image_grid_thw=grid.cuda(),
        mm_token_type_ids=(prompt == 120).long().cuda(),
    )
    with torch.inference_mode():
        features = model.get_image_features(pixels.cuda(), grid.cuda()).pooler_output
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        graphed = layergraph.wrap(model, batch_sizes=[64], compile_layers=False)
        got = model.get_image_features(pixels.cuda(), grid.cuda()).pooler_output
        assert [t.shape for t in got] == [t.shape for t in features]
        for part, expected in zip(got, features):
            assert relative_error(part, expected) <= TOLERANCE
        assert relative_error(graphed(**inputs).logits, logits) <= TOLERANCE
        assert torch.equal(graphed.generate(**inputs, max_new_tokens=4, do_sample=False), tokens)
    assert graphed.adapter.name == "qwen2_vl"
    stats = graphed.stats
    assert stats.captures == 1, stats
    assert stats.replays + stats.eager_total == 3  # get_image_features, forward, prefill
    assert stats.eager_total == 0 or stats.slower_graphs, dict(stats.eager_calls)
    graphed.unwrap()
