"""SigLIP and CLIP adapters on the CPU: towers, VLM towers, feature layers.

Models are transformers' classes built from small configs with random weights; the reference
is always the unmodified model. Graph runs use the simulated backend. Tolerance: float32, the
same kernels as eager on a zero-padded batch, so 1e-4 relative, 1e-5 absolute.
"""

from __future__ import annotations

import contextvars
import gc
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import layergraph  # noqa: E402
from layergraph.runner import StaleOutputWarning  # noqa: E402
from layergraph.testing import SimulatedGraphs, check_adapter  # noqa: E402
from layergraph_adapters.kit.feature_outputs import ON_DEMAND_REASON  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
IMAGE = 32  # 4x4 patches of 8 pixels
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=IMAGE,
    patch_size=8,
)


def siglip_config(**overrides: Any) -> Any:
    return transformers.SiglipVisionConfig(**{**SMALL, **overrides})


def clip_config(**overrides: Any) -> Any:
    return transformers.CLIPVisionConfig(**{**SMALL, "projection_dim": 32, **overrides})


def built(cls: type, config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(config).eval()


def images(batch: int, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


TOWERS = {
    "SiglipVisionModel": (
        "siglip",
        lambda: built(transformers.SiglipVisionModel, siglip_config()),
        16,
    ),
    "CLIPVisionModel": ("clip", lambda: built(transformers.CLIPVisionModel, clip_config()), 17),
    "CLIPVisionModelWithProjection": (
        "clip",
        lambda: built(transformers.CLIPVisionModelWithProjection, clip_config()),
        17,
    ),
}


@pytest.mark.parametrize("name", list(TOWERS))
def test_tower_graph_equals_eager(name: str) -> None:
    adapter, make, tokens = TOWERS[name]
    model = make()
    inputs = [images(1), images(3), images(4)]
    with torch.inference_mode():
        expected = [model(pixel_values=x) for x in inputs]
        graphed = layergraph.wrap(
            model, adapter=adapter, backend=SimulatedGraphs(), batch_sizes=[1, 4]
        )
        for x, want in zip(inputs, expected):
            got = graphed(pixel_values=x)
            assert type(got) is type(want)
            for field, value in want.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(got[field], value, rtol=RTOL, atol=ATOL)
    assert {key.sequence.tokens for key in graphed.keys} == {tokens}
    assert graphed.stats.replays == 3 and graphed.stats.padded_calls == 1


def test_siglip_layers_get_row_major_hidden_states_while_wrapped() -> None:
    """SigLIP's embeddings come out column-major; wrapped, the layers see them row-major,
    with the outputs unchanged, and unwrapping restores the model."""
    model = built(transformers.SiglipVisionModel, siglip_config())
    seen: list[bool] = []
    first_layer = next(m for n, m in model.named_modules() if n.endswith("encoder.layers.0"))
    first_layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    x = images(2)
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(model, adapter="siglip", backend=SimulatedGraphs())
        graphed.capture(pixel_values=images(1), progress=False)
        got = graphed(pixel_values=x).last_hidden_state
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        wrapped = len(seen)
        for _ in range(2):
            with graphed.original() as original:
                original(pixel_values=x)
        again = len(seen)
        graphed(pixel_values=images(3))  # a new size: its warm-up and capture run the hook
        graphed.unwrap()
        model(pixel_values=x)
    assert seen[0] is False  # the model's own layout
    assert set(seen[1:wrapped]) == {True}  # warm-up and capture, wrapped (a replay runs no hook)
    assert seen[wrapped:again] == [False, False]  # original(), each time
    assert set(seen[again:-1]) == {True} and seen[-1] is False  # wrapped again; then unwrapped


def test_siglip_attention_pooling_head_is_captured() -> None:
    model = built(transformers.SiglipVisionModel, siglip_config(vision_use_head=True))
    x = images(2)
    with torch.inference_mode():
        expected = model(pixel_values=x).pooler_output
        graphed = layergraph.wrap(model, adapter="siglip", backend=SimulatedGraphs())
        got = graphed(pixel_values=x).pooler_output
    assert got.shape == (2, 64)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("cls", "config", "adapter"),
    [
        (transformers.SiglipModel, transformers.SiglipConfig, "siglip"),
        (transformers.CLIPModel, transformers.CLIPConfig, "clip"),
    ],
)
def test_vision_half_of_a_dual_encoder(cls: type, config: type, adapter: str) -> None:
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    vision = siglip_config() if adapter == "siglip" else clip_config()
    model = built(cls, config(text_config=text, vision_config=vision.to_dict()))
    x = images(2)
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values=x)
        graphed = layergraph.wrap(model, adapter=adapter, backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=x)
    want = expected.pooler_output if not isinstance(expected, torch.Tensor) else expected
    have = got.pooler_output if not isinstance(got, torch.Tensor) else got
    torch.testing.assert_close(have, want, rtol=RTOL, atol=ATOL)
    assert graphed.stats.replays == 1


def test_feature_layer_graph_stops_early_and_matches_hidden_states() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    x = images(3)
    with torch.inference_mode():
        whole = model(pixel_values=x, output_hidden_states=True)
        expected = whole.hidden_states
        graphed = layergraph.wrap(
            model, adapter="clip", feature_layers=[-2, 1], backend=SimulatedGraphs()
        )
        got = graphed(pixel_values=x, output_hidden_states=True)
        eager = graphed(pixel_values=x)
        assert len(got.hidden_states) == 4
        for index in (1, 2):
            torch.testing.assert_close(
                got.hidden_states[index], expected[index], rtol=RTOL, atol=ATOL
            )
        assert graphed.stats.eager_total == 1  # the call without hidden states
        # What the graph did not compute comes from the whole tower, the first time it is read.
        torch.testing.assert_close(got.last_hidden_state, whole.last_hidden_state)
        torch.testing.assert_close(got.hidden_states[3], whole.hidden_states[3])
        torch.testing.assert_close(got[1], whole[1])  # pooler_output, as a tuple index
    assert eager.last_hidden_state is not None
    assert graphed.plan.feature_layers == (1, 2)
    assert graphed.stats.replays == 1
    reasons = graphed.stats.eager_calls
    assert reasons[ON_DEMAND_REASON] == 1  # the whole tower, run once for what was read
    (reason,) = set(reasons) - {ON_DEMAND_REASON}
    assert "stop after layer 2 of 3" in reason


def test_a_field_read_after_the_inference_block_is_computed_as_in_it() -> None:
    """A field the feature graph left out, read after the caller's ``inference_mode()`` block
    ended, runs the tower as the call would have: in inference mode, gradients off."""
    model = built(transformers.CLIPVisionModel, clip_config())
    x = images(2)
    with torch.inference_mode():
        whole = model(pixel_values=x)
        graphed = layergraph.wrap(
            model, adapter="clip", feature_layers=-2, backend=SimulatedGraphs()
        )
        got = graphed(pixel_values=x, output_hidden_states=True)
    last = got.last_hidden_state  # computed now, outside the block
    assert last.is_inference() and not last.requires_grad
    torch.testing.assert_close(last, whole.last_hidden_state)
    assert graphed.stats.eager_calls[ON_DEMAND_REASON] == 1


def test_a_feature_graph_first_leaves_the_whole_towers_hidden_states_whole() -> None:
    """transformers installs its hidden-state hooks on the first call that asks for hidden
    states, on the layers present then. That first call being the feature graph's, with the
    layers cut, the whole tower's later calls (eager, or through ``original()``) must still
    return every layer's hidden state."""
    model = built(transformers.CLIPVisionModel, clip_config())
    reference = built(transformers.CLIPVisionModel, clip_config())  # same seed, never wrapped
    x = images(2)
    with torch.inference_mode():
        expected = reference(pixel_values=x, output_hidden_states=True).hidden_states
        graphed = layergraph.wrap(
            model, adapter="clip", feature_layers=-2, backend=SimulatedGraphs()
        )
        graphed(pixel_values=x, output_hidden_states=True)  # the model's first call
        with graphed.original() as original:
            whole = original(pixel_values=x, output_hidden_states=True).hidden_states
        completed = graphed(pixel_values=x, output_hidden_states=True).hidden_states[3]
    assert len(whole) == len(expected) == 4
    for got, want in zip(whole, expected):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(completed, expected[3], rtol=RTOL, atol=ATOL)


def test_a_feature_graphs_output_lists_the_keys_and_values_eager_has() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    reference = built(transformers.CLIPVisionModel, clip_config())  # same seed, never wrapped
    x = images(2)
    with torch.inference_mode():
        want = reference(pixel_values=x, output_hidden_states=True)
        graphed = layergraph.wrap(
            model, adapter="clip", feature_layers=-2, backend=SimulatedGraphs()
        )
        got = graphed(pixel_values=x, output_hidden_states=True)
        assert graphed.stats.replays == 1
        assert list(got.keys()) == list(want.keys()) == list(got) == list(want)
        assert len(got) == len(want) and "last_hidden_state" in got
        assert graphed.stats.eager_total == 0  # keys learnt from shapes alone: nothing ran
        for (name, value), (other, expected) in zip(got.items(), want.items()):
            assert name == other
            if isinstance(expected, tuple):
                for state, expected_state in zip(value, expected):
                    torch.testing.assert_close(state, expected_state, rtol=RTOL, atol=ATOL)
            else:
                torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL)
        assert len(got.values()) == len(want.values())


def test_feature_outputs_the_caller_dropped_are_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """With static outputs, a feature graph's output that the caller dropped must be gone
    before the next replay, without waiting for the garbage collector (no reference cycle)."""
    model = built(transformers.CLIPVisionModel, clip_config())
    graphed = layergraph.wrap(
        model, adapter="clip", feature_layers=-2, static_output=True, backend=SimulatedGraphs()
    )
    x = images(2)
    gc.disable()
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("error", StaleOutputWarning)
            for _ in range(3):
                graphed(pixel_values=x, output_hidden_states=True).hidden_states[2].clone()
    finally:
        gc.enable()
    assert graphed.stats.overwritten_outputs == 0 and graphed.stats.replays == 3


def test_feature_layers_out_of_range_are_refused() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    with pytest.raises(ValueError, match=r"hidden_states has 4 entries"):
        layergraph.wrap(model, adapter="clip", feature_layers=[-5])


def tiny_llava(vision: str) -> torch.nn.Module:
    torch.manual_seed(0)
    text = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    vision_config = clip_config() if vision == "clip" else siglip_config()
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text,
        image_token_index=299,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full",
        image_seq_length=16,
    )
    return transformers.LlavaForConditionalGeneration(config).eval()


@pytest.mark.parametrize(("vision", "tokens"), [("clip", 17), ("siglip", 16)])
def test_llava_tower_follows_the_vlm_feature_layer(vision: str, tokens: int) -> None:
    model = tiny_llava(vision)
    pixels = images(2)
    prompt = torch.tensor([[1, 2, *[299] * tokens * 2, 3]])
    with torch.inference_mode():
        features = model.get_image_features(pixel_values=pixels)
        logits = model(input_ids=prompt, pixel_values=pixels).logits
        graphed = layergraph.wrap(model, adapter=vision, backend=SimulatedGraphs())
        got_features = graphed.get_image_features(pixel_values=pixels)
        got_logits = graphed(input_ids=prompt, pixel_values=pixels).logits
    want = (
        features.pooler_output
        if not isinstance(features, (torch.Tensor, list, tuple))
        else features
    )
    have = (
        got_features.pooler_output
        if not isinstance(got_features, (torch.Tensor, list, tuple))
        else got_features
    )
    torch.testing.assert_close(torch.cat(list(have)), torch.cat(list(want)), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_logits, logits, rtol=RTOL, atol=ATOL)
    assert graphed.plan.feature_layers == (2,)
    # Learning the keys of the whole tower's output, once, is the only eager run, and counted.
    assert graphed.stats.replays == 2 and set(graphed.stats.eager_calls) <= {ON_DEMAND_REASON}
    assert graphed.stats.eager_total <= 1
    if not isinstance(features, (torch.Tensor, list, tuple)):  # an output with more in it
        with torch.inference_mode():
            torch.testing.assert_close(
                got_features.last_hidden_state, features.last_hidden_state, rtol=RTOL, atol=ATOL
            )
    graphed.unwrap()
    assert "forward" not in model.model.vision_tower.__dict__


def test_paligemma_tower_runs_whole() -> None:
    torch.manual_seed(0)
    text = transformers.GemmaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=300,
    )
    config = transformers.PaliGemmaConfig(
        vision_config=siglip_config(projection_dim=64),
        text_config=text,
        image_token_index=299,
        projection_dim=64,
    )
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    pixels = images(1)
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values=pixels)
        graphed = layergraph.wrap(model, adapter="siglip", backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=pixels)
    want = expected if isinstance(expected, torch.Tensor) else expected.pooler_output
    have = got if isinstance(got, torch.Tensor) else got.pooler_output
    torch.testing.assert_close(have, want, rtol=RTOL, atol=ATOL)
    assert graphed.plan.feature_layers is None and graphed.stats.replays == 1


def test_other_image_sizes_need_interpolation() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    x = images(1, 48)
    with torch.inference_mode():
        expected = model(pixel_values=x, interpolate_pos_encoding=True)
        graphed = layergraph.wrap(model, adapter="clip", backend=SimulatedGraphs())
        with pytest.raises(ValueError, match="interpolate_pos_encoding=True"):
            graphed(pixel_values=x)
        got = graphed(pixel_values=x, interpolate_pos_encoding=True)
    torch.testing.assert_close(
        got.last_hidden_state, expected.last_hidden_state, rtol=RTOL, atol=ATOL
    )
    assert {key.sequence.tokens for key in graphed.keys} == {37}


def test_models_without_a_tower_are_refused() -> None:
    with pytest.raises(layergraph.AdapterMismatch, match="SiglipVisionModel"):
        layergraph.wrap(torch.nn.Linear(2, 2), adapter="siglip")
    with pytest.raises(layergraph.AdapterMismatch, match="CLIPVisionModel"):
        layergraph.wrap(torch.nn.Sequential(), adapter="clip")


def test_llava_next_tower_serves_its_patches() -> None:
    torch.manual_seed(0)
    text = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    config = transformers.LlavaNextConfig(
        vision_config=clip_config(),
        text_config=text,
        image_token_index=299,
        vision_feature_layer=-2,
        image_grid_pinpoints=[[IMAGE, IMAGE], [IMAGE, 2 * IMAGE]],
    )
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    pixels = torch.randn(1, 3, 3, IMAGE, IMAGE)  # one image: a base view and two grid tiles
    sizes = torch.tensor([[IMAGE, 2 * IMAGE]])
    with torch.inference_mode():
        expected = model.get_image_features(pixel_values=pixels, image_sizes=sizes)
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = graphed.get_image_features(pixel_values=pixels, image_sizes=sizes)
    want = expected if isinstance(expected, (list, tuple)) else expected.pooler_output
    have = got if isinstance(got, (list, tuple)) else got.pooler_output
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert graphed.adapter.name == "clip" and graphed.plan.feature_layers == (2,)
    assert graphed.stats.replays == 1 and graphed.stats.eager_total == 0


@pytest.mark.parametrize("name", list(TOWERS))
def test_eager_path_without_cuda_equals_the_model(name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the path taken without a GPU")
    adapter, make, _ = TOWERS[name]
    model = make()
    x = images(2)
    with torch.inference_mode():
        expected = model(pixel_values=x)
        graphed = layergraph.wrap(model, adapter=adapter)
        got = graphed(pixel_values=x)
    for field, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[field], value, rtol=0, atol=0)
    assert graphed.stats.eager_calls == {"CUDA is not available": 1}


def test_a_routed_tower_cannot_be_wrapped_twice() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    first = layergraph.wrap(model, backend=SimulatedGraphs())
    with pytest.raises(TypeError, match=r"CLIPVisionModel is wrapped already"):
        layergraph.wrap(model, backend=SimulatedGraphs())
    vlm_like = torch.nn.Module()  # a second model holding the routed tower
    vlm_like.add_module("vision_model", model)
    with pytest.raises(RuntimeError, match="already routed to graphs by another wrapper"):
        layergraph.wrap(vlm_like, adapter="clip", backend=SimulatedGraphs())
    first.unwrap()
    second = layergraph.wrap(model, backend=SimulatedGraphs())
    x = images(1)
    with torch.inference_mode():
        torch.testing.assert_close(
            second(pixel_values=x).last_hidden_state,
            type(model).forward(model, pixel_values=x).last_hidden_state,
            rtol=RTOL,
            atol=ATOL,
        )
    assert second.stats.replays == 1 and second.stats.eager_total == 0


@pytest.mark.parametrize("name", list(TOWERS))
def test_check_adapter_passes(name: str) -> None:
    adapter, make, _ = TOWERS[name]
    result = check_adapter(make(), adapter, lambda batch: ((), {"pixel_values": images(batch)}))
    assert result.graphed.adapter.name == adapter


def test_register_adapter_fixture_makes_a_local_adapter_available(
    register_adapter: Any,
) -> None:
    class Tower(layergraph.Adapter):
        name = "my-tower"

        def plan(
            self, model: torch.nn.Module, context: layergraph.PlanContext
        ) -> layergraph.CapturePlan:
            return layergraph.WholeForward(model)

    register_adapter(Tower)
    model = built(transformers.CLIPVisionModel, clip_config())
    result = check_adapter(model, "my-tower", lambda batch: ((images(batch),), {}))
    assert isinstance(result.graphed.adapter, Tower)


def test_compile_layers_on_a_tower() -> None:
    model = built(transformers.SiglipVisionModel, siglip_config())
    x = images(3)
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state
        graphed = layergraph.wrap(
            model, backend=SimulatedGraphs(), compile_layers={"backend": "aot_eager"}
        )
        got = graphed(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert len(graphed.plan.layers()) == 3


@pytest.mark.parametrize("name", list(TOWERS))
def test_fused_qkv_weights_are_views_and_outputs_unchanged(name: str) -> None:
    adapter, make, _ = TOWERS[name]
    model = make()
    keys = set(model.state_dict())
    inputs = [images(1), images(3)]
    with torch.inference_mode():
        expected = [model(pixel_values=x) for x in inputs]
        graphed = layergraph.wrap(
            model, adapter=adapter, fuse_qkv=True, backend=SimulatedGraphs(), batch_sizes=[1, 4]
        )
        for x, want in zip(inputs, expected):
            got = graphed(pixel_values=x)
            torch.testing.assert_close(
                got.last_hidden_state, want.last_hidden_state, rtol=RTOL, atol=ATOL
            )
    attention = graphed.plan.attention_modules()[1]
    fused = graphed.plan.fusions[1]
    step = attention.q_proj.weight.numel() * attention.q_proj.weight.element_size()
    assert attention.q_proj.weight.data_ptr() == fused.weight.data_ptr()
    assert attention.v_proj.weight.data_ptr() == fused.weight.data_ptr() + 2 * step
    assert set(model.state_dict()) == keys
    assert graphed.stats.replays == 2


def test_fused_qkv_follows_in_place_updates_and_reallocation() -> None:
    model = built(transformers.SiglipVisionModel, siglip_config())
    graphed = layergraph.wrap(model, fuse_qkv=True, backend=SimulatedGraphs())
    x = images(2)
    model.load_state_dict({k: torch.randn_like(v) * 0.05 for k, v in model.state_dict().items()})
    with torch.inference_mode():
        got = graphed(pixel_values=x).last_hidden_state
        model.double()  # re-allocates every parameter: fused again before the next capture
        got_double = graphed(pixel_values=x.double()).last_hidden_state
        with graphed.original() as original:
            torch.testing.assert_close(
                got_double, original(pixel_values=x.double()).last_hidden_state
            )
            original.float()
            torch.testing.assert_close(
                got, original(pixel_values=x).last_hidden_state, rtol=RTOL, atol=ATOL
            )


def test_a_model_fused_and_reallocated_in_inference_mode_is_restored_outside_it() -> None:
    """Re-allocated (``double()``) in inference mode, so that its parameters are inference
    tensors, wrapped with ``fuse_qkv`` and called there, unwrapped outside it: the parameters
    get their own storage back with their values."""
    model = built(transformers.SiglipVisionModel, siglip_config())
    x = images(2).double()
    with torch.inference_mode():
        model.double()
        graphed = layergraph.wrap(model, backend=SimulatedGraphs(), fuse_qkv=True)
        got = graphed(pixel_values=x).last_hidden_state
        values = {name: p.clone() for name, p in model.named_parameters()}
    graphed.unwrap()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, values[name]), name
    with torch.inference_mode():
        torch.testing.assert_close(model(pixel_values=x).last_hidden_state, got)


def test_fused_qkv_attention_weights_still_come_back() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    model.set_attn_implementation("eager")
    x = images(2)
    with torch.inference_mode():
        expected = model(pixel_values=x, output_attentions=True)
        graphed = layergraph.wrap(model, fuse_qkv=True, backend=SimulatedGraphs())
        got = graphed(pixel_values=x, output_attentions=True)
    assert len(got.attentions) == 3
    for mine, theirs in zip(got.attentions, expected.attentions):
        torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)


def dynamo_traces_context_variables() -> bool:
    """Whether this PyTorch's Dynamo reads ``ContextVar.get()`` without a graph break (the
    InternVL adapter's attention finds its bound state that way)."""
    variable: contextvars.ContextVar[int] = contextvars.ContextVar("probe", default=1)
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: (x + 1) * variable.get() + 1, backend=counting_backend)(torch.ones(2))
    torch._dynamo.reset()
    return len(graphs) == 1


@pytest.mark.parametrize("adapter", ["siglip", "internvl"])
def test_compiled_layers_with_fused_qkv_are_one_graph_per_layer_shape(adapter: str) -> None:
    """One graph per layer; where Dynamo cannot read a context variable (torch 2.11, for one),
    InternVL's layer breaks at its attention's state lookup only: before, in and after the
    attention."""
    if adapter == "siglip":
        model = built(transformers.SiglipVisionModel, siglip_config())
        call = {"pixel_values": images(2)}
    else:
        config = transformers.InternVLVisionConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            image_size=[32, 32],
            patch_size=[16, 16],
        )
        model = built(transformers.InternVLVisionModel, config)
        call = {"pixel_values": torch.randn(2, 3, 32, 32)}
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        expected = model(**call).last_hidden_state
        graphed = layergraph.wrap(
            model,
            adapter=adapter,
            fuse_qkv=True,
            compile_layers={"backend": counting_backend},
            backend=SimulatedGraphs(),
        )
        got = graphed(**call).last_hidden_state
        graphed.unwrap()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    breaks_at_state = adapter == "internvl" and not dynamo_traces_context_variables()
    assert len(graphs) == (3 if breaks_at_state else 1), "a graph break inside the compiled layer"


def test_fuse_qkv_refuses_attention_without_separate_projections() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.1.self_attn"))
    attention.qkv = torch.nn.Linear(64, 192)
    del attention.q_proj
    with pytest.raises(ValueError, match=r"q_proj, k_proj and v_proj.*CLIPAttention"):
        layergraph.wrap(model, fuse_qkv=True, backend=SimulatedGraphs())


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_compiled_region_of_a_tower_is_one_graph(fuse_qkv: bool) -> None:
    model = built(transformers.SiglipVisionModel, siglip_config())
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = images(2)
    with torch.inference_mode():
        expected = model(pixel_values=x).pooler_output
        graphed = layergraph.wrap(
            model,
            fuse_qkv=fuse_qkv,
            compile_region={"backend": counting_backend},
            backend=SimulatedGraphs(),
        )
        got = graphed(pixel_values=x).pooler_output
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    # Every layer, the head and the norms in one graph; the fusion check runs outside it.
    assert len(graphs) == 1
    assert sum(node.op == "call_function" for node in graphs[0].graph.nodes) > 3 * 10


def test_image_sizes_with_equal_token_counts_are_told_apart_in_keys() -> None:
    model = built(transformers.CLIPVisionModel, clip_config())
    graphed = layergraph.wrap(model, adapter="clip", backend=SimulatedGraphs())
    with torch.inference_mode():
        for height, width in ((56, 72), (72, 56)):  # 7x9 and 9x7 patches: 64 tokens each
            pixels = torch.randn(1, 3, height, width)
            graphed(pixel_values=pixels, interpolate_pos_encoding=True)
    assert sorted(str(key) for key in graphed.keys) == [
        "(batch=1, sequence=64 tokens (56x72))",
        "(batch=1, sequence=64 tokens (72x56))",
    ]


def test_a_llava_forward_reads_its_feature_graph_without_running_the_tower_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LLaVA's own output turns its tower's output into a tuple (``to_tuple()``) whenever it
    is indexed (transformers 5.24): the keys of the whole tower's output are learnt from a
    run on fake tensors, and no call runs an eager tower beside the feature graph."""
    import tiny_models

    from layergraph_adapters.kit import feature_outputs

    whole_runs: list[int] = []
    whole = feature_outputs._Rest.whole

    def counted(self: Any) -> Any:
        if self._compute is not None:
            whole_runs.append(1)
        return whole(self)

    monkeypatch.setattr(feature_outputs._Rest, "whole", counted)
    tiny = tiny_models.VLMS["LlavaForConditionalGeneration"]
    model, reference = tiny.build(), tiny.build()  # the same seed
    prompt = {**tiny_models.tokens(17 * 2), **tiny_models.pixels(2)}
    with torch.inference_mode():
        want = reference(**prompt).logits
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        for _ in range(3):
            torch.testing.assert_close(model(**prompt).logits, want, rtol=RTOL, atol=ATOL)
    assert graphed.stats.replays == 3 and graphed.stats.eager_total == 0
    assert not whole_runs
    graphed.unwrap()
