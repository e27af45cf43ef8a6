"""InternViT on the GPU: graph equals eager per attention backend, stable buffers, a VLM.

Marked ``cuda`` and skipped without a GPU. Models are transformers' classes built from the
InternViT-300M and InternViT-6B configurations with random weights, in bf16. Tolerance: the
graph is compared with the adapter's eager path on the same backend (relative error at most
2e-2, bf16's :data:`~layergraph.validation.DEFAULT_TOLERANCE`; at an exact batch size they
normally agree to the bit), and with the unmodified transformers model (its SDPA attention),
where a different attention kernel in bf16 over 24 or 45 layers is accepted up to 5e-2.
"""

from __future__ import annotations

import pytest
import torch

import layergraph
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.internvl import INTERNVIT_CONFIGS, build_internvit

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.cuda

BACKENDS = ["sdpa", "triton", "fa3", "auto"]
TO_TRANSFORMERS = 5e-2


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_internvit(name, torch.bfloat16, "cuda")


def tiles(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 448, 448, device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def internvit_300m() -> torch.nn.Module:
    return build("internvit-300m")


@pytest.mark.parametrize("attention", BACKENDS)
def test_internvit_300m_graph_equals_eager(internvit_300m: torch.nn.Module, attention: str) -> None:
    model = internvit_300m
    inputs = {batch: tiles(batch) for batch in (1, 2, 5, 8)}
    with torch.inference_mode():
        reference = {b: model(pixel_values=x).last_hidden_state for b, x in inputs.items()}
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention=attention,
            batch_sizes=[1, 2, 4, 8],
            compile_layers=False,
        )
        try:
            for batch, x in inputs.items():
                got = graphed(pixel_values=x).last_hidden_state
                eager = graphed.plan.region(pixel_values=x).last_hidden_state
                assert got.shape == (batch, 1025, 1024)
                assert relative_error(got, eager) <= DEFAULT_TOLERANCE[torch.bfloat16]
                assert relative_error(got, reference[batch]) <= TO_TRANSFORMERS
        finally:
            graphed.unwrap()
    stats = graphed.stats
    assert stats.replays == 4 and stats.padded_calls == 1 and stats.eager_total == 0


@pytest.fixture(scope="module")
def internvit_6b() -> torch.nn.Module:
    return build("internvit-6b")


@pytest.mark.parametrize("attention", BACKENDS)
def test_internvit_6b_graph_equals_eager(internvit_6b: torch.nn.Module, attention: str) -> None:
    model = internvit_6b
    x = tiles(1)
    with torch.inference_mode():
        reference = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(
            model, adapter="internvl", attention=attention, batch_sizes=[1], compile_layers=False
        )
        got = graphed(pixel_values=x).last_hidden_state
        eager = graphed.plan.region(pixel_values=x).last_hidden_state
    assert relative_error(got, eager) <= DEFAULT_TOLERANCE[torch.bfloat16]
    assert relative_error(got, reference) <= TO_TRANSFORMERS
    assert graphed.stats.replays == 1
    graphed.unwrap()


def test_captured_buffers_keep_their_addresses(internvit_300m: torch.nn.Module) -> None:
    graphed = layergraph.wrap(
        internvit_300m,
        adapter="internvl",
        attention="triton",
        batch_sizes=[2],
        compile_layers=False,
    )
    try:
        with torch.inference_mode():
            graphed(pixel_values=tiles(2))
            (entry,) = graphed.graphs
            state = entry.buffers.state
            addresses = (
                entry.buffers.inputs[0].data_ptr(),
                state.workspace.data_ptr(),
                state.metadata.cu_seqlens.data_ptr(),
                state.metadata.seq_lens.data_ptr(),
            )
            for _ in range(3):
                x = tiles(2)
                got = graphed(pixel_values=x).last_hidden_state
                eager = graphed.plan.region(pixel_values=x).last_hidden_state
                assert relative_error(got, eager) <= DEFAULT_TOLERANCE[torch.bfloat16]
                assert (
                    entry.buffers.inputs[0].data_ptr(),
                    state.workspace.data_ptr(),
                    state.metadata.cu_seqlens.data_ptr(),
                    state.metadata.seq_lens.data_ptr(),
                ) == addresses
            assert state.metadata.cu_seqlens.tolist() == [0, 1025, 2050]
    finally:
        graphed.unwrap()


def test_fa3_reports_which_kernel_ran(internvit_300m: torch.nn.Module) -> None:
    graphed = layergraph.wrap(
        internvit_300m, adapter="internvl", attention="fa3", batch_sizes=[1], compile_layers=False
    )
    try:
        with torch.inference_mode():
            graphed(pixel_values=tiles(1))
        (description,) = graphed.plan.attention_by_key.values()
        assert description.startswith("fa3 (") and (
            "FA3" in description or "torch.nn.attention.varlen" in description
        )
    finally:
        graphed.unwrap()


def test_whole_vlm_image_features_run_through_the_graph() -> None:
    torch.manual_seed(0)
    text = transformers.Qwen2Config(
        hidden_size=896,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=2000,
    )
    config = transformers.InternVLConfig(
        vision_config=transformers.InternVLVisionConfig(**INTERNVIT_CONFIGS["internvit-300m"]),
        text_config=text,
        image_token_id=1999,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
    )
    with torch.device("cuda"):
        model = transformers.InternVLForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    pixels = tiles(3)
    prompt = torch.tensor([[1, 2, *[1999] * 256 * 3, 3]], device="cuda")
    with torch.inference_mode():
        features = model.get_image_features(pixel_values=pixels).pooler_output
        logits = model(input_ids=prompt, pixel_values=pixels).logits
        graphed = layergraph.wrap(
            model, adapter="internvl", attention="triton", compile_layers=False
        )
        got = graphed.get_image_features(pixel_values=pixels).pooler_output
        got_logits = graphed(input_ids=prompt, pixel_values=pixels).logits
        generated = graphed.generate(input_ids=prompt, pixel_values=pixels, max_new_tokens=2)
    assert relative_error(got, features) <= TO_TRANSFORMERS
    assert relative_error(got_logits, logits) <= TO_TRANSFORMERS
    assert generated.shape == (1, prompt.shape[1] + 2)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert graphed.unwrap() is model


def test_fused_qkv_and_compiled_layers_equal_eager(internvit_300m: torch.nn.Module) -> None:
    model = internvit_300m
    inputs = {batch: tiles(batch) for batch in (1, 3)}
    torch._dynamo.reset()
    with torch.inference_mode():
        reference = {b: model(pixel_values=x).last_hidden_state for b, x in inputs.items()}
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="triton",
            fuse_qkv=True,
            compile_layers=True,
            batch_sizes=[1, 4],
        )
        try:
            for batch, x in inputs.items():
                got = graphed(pixel_values=x).last_hidden_state
                assert relative_error(got, reference[batch]) <= TO_TRANSFORMERS
        finally:
            graphed.unwrap()
    assert graphed.stats.replays == 2 and graphed.stats.eager_total == 0
