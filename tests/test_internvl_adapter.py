"""The InternVL adapter on the CPU: metadata, eager and simulated-graph equality, VLM towers.

Models are transformers' own classes built from small configs with random weights. The
reference is always the unmodified transformers model. Tolerance: float32 throughout; the
adapter's attention computes the same softmax(q k^T) v as transformers' with other kernels
(SDPA, or the Triton kernel under the interpreter), so outputs agree to 1e-4 relative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import layergraph  # noqa: E402
from layergraph.attention import AttentionMetadata, SequenceLayout  # noqa: E402
from layergraph.plugins import AdapterRegistry, get_registry  # noqa: E402
from layergraph.testing import SimulatedGraphs, check_adapter  # noqa: E402
from layergraph_adapters.internvl import InternVLAdapter  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
TILE = 32  # 2x2 patches of 16 pixels, plus the class token: 5 tokens per tile
TOKENS = (TILE // 16) ** 2 + 1


def vision_config(**overrides: Any) -> Any:
    settings = dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        image_size=[TILE, TILE],
        patch_size=[16, 16],
    )
    return transformers.InternVLVisionConfig(**{**settings, **overrides})


def tower(**overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.InternVLVisionModel(vision_config(**overrides)).eval()


def tiles(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, TILE, TILE)


@pytest.fixture
def triton_interpreter(runnable_triton: None) -> None:
    """The Triton backend on CPU tensors, through the interpreter (set up in conftest.py)."""
    if torch.cuda.is_available():
        pytest.skip("runs the Triton backend on CPU tensors, for machines without a GPU")


@pytest.mark.parametrize(
    ("backend", "cu_seqlens", "seq_lens"),
    [
        ("sdpa", None, None),
        ("triton", [0, 1025, 2050, 3075], [1025, 1025, 1025]),
        ("fa3", [0, 1025, 2050, 3075], None),
    ],
)
def test_metadata_each_backend_builds(backend: str, cu_seqlens: Any, seq_lens: Any) -> None:
    layout = SequenceLayout.uniform(3, 1025)
    metadata = get_registry().attention_metadata(
        backend=backend, layout=layout, device=torch.device("cpu")
    )
    assert metadata.max_seqlen == 1025
    for got, want in ((metadata.cu_seqlens, cu_seqlens), (metadata.seq_lens, seq_lens)):
        if want is None:
            assert got is None
        else:
            assert got.dtype == torch.int32 and got.tolist() == want


def test_packed_layout_metadata() -> None:
    layout = SequenceLayout((5, 17, 1))
    metadata = get_registry().attention_metadata(
        backend="triton", layout=layout, device=torch.device("cpu")
    )
    assert metadata.cu_seqlens.tolist() == [0, 5, 22, 23]
    assert metadata.seq_lens.tolist() == [5, 17, 1] and metadata.max_seqlen == 17
    assert str(layout) == "5+17+1" and str(SequenceLayout.uniform(2, 9)) == "2x9"


@pytest.mark.parametrize("attention", ["sdpa", "auto"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["300M-like", "6B-like qk-norm rmsnorm"])
def test_eager_path_equals_transformers(attention: str, qk_norm: bool) -> None:
    overrides = {"use_qk_norm": True, "norm_type": "rms_norm"} if qk_norm else {}
    model = tower(**overrides)
    x = tiles(3)
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(model, adapter="internvl", attention=attention)
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert graphed.stats.eager_total == 1


def test_triton_backend_eager_and_graph_equal_transformers(triton_interpreter: None) -> None:
    model = tower()
    inputs = [tiles(3), tiles(4)]
    with torch.inference_mode():
        expected = [model(pixel_values=x).last_hidden_state for x in inputs]
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="triton",
            backend=SimulatedGraphs(),
            batch_sizes=[4],
        )
        for x, want in zip(inputs, expected):
            torch.testing.assert_close(
                graphed(pixel_values=x).last_hidden_state, want, rtol=RTOL, atol=ATOL
            )
    (key,) = graphed.keys
    assert graphed.plan.attention_by_key[key] == "triton (triton)"


def test_padding_never_changes_a_real_tile() -> None:
    model = tower()
    x = tiles(5)
    with torch.inference_mode():
        alone = torch.cat([model(pixel_values=x[i : i + 1]).last_hidden_state for i in range(5)])
        graphed = layergraph.wrap(
            model, adapter="internvl", backend=SimulatedGraphs(), batch_sizes=[8]
        )
        padded = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(padded, alone, rtol=RTOL, atol=ATOL)
    assert graphed.stats.padded_calls == 1
    assert [key.sequence.tokens for key in graphed.keys] == [TOKENS]


def test_workspace_is_sized_per_key_from_the_model(triton_interpreter: None) -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="internvl", attention="triton", backend=SimulatedGraphs(), batch_sizes=[2]
    )
    with torch.inference_mode():
        graphed(pixel_values=tiles(2))
    (entry,) = graphed.graphs
    assert entry.buffers.state.workspace.shape == (2 * TOKENS, 2, 64)
    assert entry.buffers.state.workspace.dtype == torch.float32


def test_missing_head_count_is_a_clear_error() -> None:
    model = tower()
    object.__setattr__(model.config, "num_attention_heads", None)
    with pytest.raises(layergraph.AdapterMismatch, match="num_attention_heads"):
        layergraph.wrap(model, adapter="internvl")


def test_metadata_hook_override_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, SequenceLayout]] = []

    class Override:
        @layergraph.hookimpl
        def attention_metadata(
            self, backend: str, layout: SequenceLayout, device: torch.device
        ) -> AttentionMetadata:
            calls.append((backend, layout))
            return AttentionMetadata(max_seqlen=layout.max_length)

    registry = AdapterRegistry()
    registry.load_entry_points()
    registry.add_plugin(Override(), "override")
    monkeypatch.setattr("layergraph.plugins._registry", registry)
    graphed = layergraph.wrap(
        tower(), adapter="internvl", attention="sdpa", backend=SimulatedGraphs(), batch_sizes=[2]
    )
    with torch.inference_mode():
        graphed(pixel_values=tiles(2))
    assert set(calls) == {("sdpa", SequenceLayout.uniform(2, TOKENS))}  # graph, eager calls
    (entry,) = graphed.graphs
    assert entry.buffers.state.metadata == AttentionMetadata(max_seqlen=TOKENS)


def test_attention_weights_run_eagerly_with_the_reason() -> None:
    model = tower()
    x = tiles(2)
    with torch.inference_mode():
        expected = model(pixel_values=x, output_attentions=True)
        graphed = layergraph.wrap(model, adapter="internvl", backend=SimulatedGraphs())
        out = graphed(pixel_values=x, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state)
    assert len(out.attentions) == len(expected.attentions)
    assert graphed.stats.eager_calls == {
        "attention weights were asked for (output_attentions=True)": 1
    }


def test_bad_options_and_models_are_refused() -> None:
    with pytest.raises(ValueError, match="attention='flash': choose one of sdpa, triton, fa3"):
        layergraph.wrap(tower(), adapter="internvl", attention="flash")
    with pytest.raises(layergraph.AdapterMismatch, match="InternVLVisionModel"):
        layergraph.wrap(torch.nn.Linear(2, 2), adapter="internvl")
    graphed = layergraph.wrap(tower(), adapter="internvl", backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match="expected 3 channels, got 1"):
        graphed(pixel_values=torch.randn(1, 1, TILE, TILE))
    assert graphed.stats.graphs == 0


def tiny_vlm() -> torch.nn.Module:
    torch.manual_seed(0)
    text = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
    )
    config = transformers.InternVLConfig(
        vision_config=vision_config(image_size=[64, 64]),
        text_config=text,
        image_token_id=299,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
    )
    return transformers.InternVLForConditionalGeneration(config).eval()


def test_wrapped_vlm_serves_image_features_and_generate_from_graphs() -> None:
    model = tiny_vlm()
    pixels = torch.randn(2, 3, 64, 64)
    prompt = torch.tensor([[1, 2, *[299] * 8, 3]])
    with torch.inference_mode():
        features = model.get_image_features(pixel_values=pixels).pooler_output
        tokens = model.generate(input_ids=prompt, pixel_values=pixels, max_new_tokens=3)
        graphed = layergraph.wrap(model, adapter="internvl", backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=pixels).pooler_output
        torch.testing.assert_close(got, features, rtol=RTOL, atol=ATOL)
        assert torch.equal(
            graphed.generate(input_ids=prompt, pixel_values=pixels, max_new_tokens=3), tokens
        )
        graphed(input_ids=prompt, pixel_values=pixels)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert graphed.unwrap() is model
    assert "forward" not in model.model.vision_tower.__dict__


def test_capture_ahead_takes_pixel_values_for_a_vlm() -> None:
    graphed = layergraph.wrap(
        tiny_vlm(), adapter="internvl", backend=SimulatedGraphs(), batch_sizes=[1, 4]
    )
    with torch.inference_mode():
        keys = graphed.capture(pixel_values=torch.randn(1, 3, 64, 64), progress=False)
    assert [(key.batch, str(key.sequence)) for key in keys] == [
        (4, "17 tokens (64x64)"),
        (1, "17 tokens (64x64)"),
    ]


def test_recognizes_towers_and_vlms() -> None:
    adapter = InternVLAdapter()
    assert adapter.recognizes(tower()) and adapter.recognizes(tiny_vlm())
    assert not adapter.recognizes(torch.nn.Linear(2, 2))


def test_triton_backend_eager_path_equals_transformers(triton_interpreter: None) -> None:
    model = tower()
    x = tiles(2)
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(model, adapter="internvl", attention="triton")
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert graphed.stats.eager_total == 1


def test_internvl_model_tower_is_found_and_restored() -> None:
    vlm = tiny_vlm()
    model = vlm.model
    assert isinstance(model, transformers.InternVLModel)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values=pixels).pooler_output
        graphed = layergraph.wrap(model, adapter="internvl", backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert graphed.stats.replays == 1
    graphed.unwrap()
    assert "forward" not in model.vision_tower.__dict__


def test_from_pretrained_local_weights_then_wrap(tmp_path: Any) -> None:
    saved = tower()
    saved.save_pretrained(tmp_path)
    loaded = transformers.InternVLVisionModel.from_pretrained(tmp_path).eval()
    x = tiles(2)
    with torch.inference_mode():
        expected = saved(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(loaded, adapter="internvl", backend=SimulatedGraphs())
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("attention", ["sdpa", "auto"])
def test_check_adapter_passes(attention: str) -> None:
    result = check_adapter(
        tower(),
        "internvl",
        lambda batch: ((), {"pixel_values": tiles(batch)}),
        attention=attention,
    )
    (description,) = set(result.graphed.plan.attention_by_key.values())
    assert description == "sdpa (sdpa)"


@pytest.mark.parametrize("qk_norm", [False, True], ids=["300M-like", "6B-like qk-norm rmsnorm"])
def test_fused_qkv_weights_are_views_and_outputs_unchanged(qk_norm: bool) -> None:
    overrides = {"use_qk_norm": True, "norm_type": "rms_norm"} if qk_norm else {}
    model = tower(**overrides)
    keys = set(model.state_dict())
    inputs = [tiles(1), tiles(3)]
    with torch.inference_mode():
        expected = [model(pixel_values=x).last_hidden_state for x in inputs]
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="sdpa",
            fuse_qkv=True,
            backend=SimulatedGraphs(),
            batch_sizes=[1, 4],
        )
        for x, want in zip(inputs, expected):
            got = graphed(pixel_values=x).last_hidden_state
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    attention = model.encoder.layer[0].attention
    fused = graphed.plan.fusions[0]
    step = attention.q_proj.weight.numel() * attention.q_proj.weight.element_size()
    assert attention.q_proj.weight.data_ptr() == fused.weight.data_ptr()
    assert attention.v_proj.weight.data_ptr() == fused.weight.data_ptr() + 2 * step
    assert set(model.state_dict()) == keys


def test_fused_qkv_follows_weight_updates_and_reallocation() -> None:
    model = tower()
    graphed = layergraph.wrap(
        model, adapter="internvl", attention="sdpa", fuse_qkv=True, backend=SimulatedGraphs()
    )
    x = tiles(2)
    fresh = {k: torch.randn_like(v) * 0.05 for k, v in model.state_dict().items()}
    model.load_state_dict(fresh)  # in place: reaches the fused tensor
    with torch.inference_mode():
        got = graphed(pixel_values=x).last_hidden_state
        model.double()  # re-allocates every parameter: fused again
        got_double = graphed(pixel_values=x.double()).last_hidden_state
    graphed.unwrap()
    with torch.inference_mode():
        torch.testing.assert_close(got_double, model(pixel_values=x.double()).last_hidden_state)
        model.float()
        torch.testing.assert_close(
            got, model(pixel_values=x).last_hidden_state, rtol=RTOL, atol=ATOL
        )


def test_fused_qkv_with_the_triton_backend(triton_interpreter: None) -> None:
    model = tower()
    x = tiles(2)
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="triton",
            fuse_qkv=True,
            backend=SimulatedGraphs(),
        )
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_compiled_layers_keep_the_triton_kernel_as_one_operator(triton_interpreter: None) -> None:
    """The compiled layer holds the routed attention as one opaque operator, which runs the
    bound backend's kernel (Triton's varlen kernel, here) at run time, never traced into it."""
    model = tower()
    x = tiles(2)
    traced: list[str] = []
    launched: list[str] = []
    kernel = layergraph.attention.TritonVarlenAttention.__call__

    def counting_kernel(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched.append(self.name)
        return kernel(self, *args, **kwargs)

    def recording_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="triton",
            compile_layers={"backend": recording_backend},
            backend=SimulatedGraphs(),
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layergraph.attention.TritonVarlenAttention, "__call__", counting_kernel)
            got = graphed(pixel_values=x).last_hidden_state
        graphed.unwrap()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert "layergraph.opaque_attention" in traced
    assert not any("varlen" in target or "triton_kernel" in target for target in traced)
    assert launched and set(launched) == {"triton"}
