"""fuse_norm on the CPU, through Triton's interpreter: each served family of layers rewritten
through wrap, against the unmodified model, and undone by unwrap().

Models are small random ones (transformers' InternViT with LayerNorm and with RMSNorm, CLIP
and SigLIP towers, timm ViTs with and without layer scale, an open_clip ViT with layer scale),
in float32 and bfloat16. Wrapped outputs (simulated graphs) are held to
:data:`~layergraph.validation.DEFAULT_TOLERANCE` of the dtype against the model's own output
computed before wrapping: 1e-4 relative in float32, 2e-2 in bfloat16 (the kernel rounds once
where eager rounds after each operation). Layer scales are set far from 1 (0.5 to 1.5, per
channel) so that leaving one out would show.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import layergraph
from layergraph.kernels import add_norm as kernel
from layergraph.testing import SimulatedGraphs
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit.fused_norm import FusedAddNorm, fused_norm_unavailable, fused_norms

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

pytestmark = pytest.mark.skipif(
    fused_norm_unavailable(torch.device("cpu")) is not None,
    reason="runs the kernel on CPU tensors, through Triton's interpreter",
)
IMAGE = 32


def _scaled(model: nn.Module) -> nn.Module:
    """``model`` with every layer scale drawn from [0.5, 1.5] per channel."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("lambda_1", "lambda_2", "gamma")):
                parameter.uniform_(0.5, 1.5)
    return model


def internvit(norm_type: str) -> nn.Module:
    config = transformers.InternVLVisionConfig(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=[IMAGE, IMAGE],
        patch_size=[16, 16],
        norm_type=norm_type,
        use_qk_norm=norm_type == "rms_norm",
    )
    return _scaled(transformers.InternVLVisionModel(config))


def clip_style(class_name: str) -> nn.Module:
    config = getattr(transformers, class_name.replace("Model", "Config"))(
        hidden_size=80, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2
    )
    config.image_size, config.patch_size = IMAGE, 8
    return getattr(transformers, class_name)(config)


def timm_vit(init_values: float | None) -> nn.Module:
    model = timm.create_model(
        "vit_tiny_patch16_224",
        img_size=IMAGE,
        depth=2,
        embed_dim=72,
        num_heads=2,
        num_classes=5,
        init_values=init_values,
    )
    return _scaled(model)


def open_clip_vit() -> nn.Module:
    from open_clip.transformer import VisionTransformer

    model = VisionTransformer(
        image_size=IMAGE,
        patch_size=8,
        width=64,
        layers=2,
        heads=2,
        mlp_ratio=2.0,
        ls_init_value=1e-5,
        output_dim=16,
    )
    return _scaled(model)


MODELS: dict[str, tuple[Callable[[], nn.Module], str, dict[str, Any]]] = {
    "internvit layer_norm": (lambda: internvit("layer_norm"), "internvl", {"attention": "sdpa"}),
    "internvit rms_norm": (lambda: internvit("rms_norm"), "internvl", {"attention": "sdpa"}),
    "clip": (lambda: clip_style("CLIPVisionModel"), "clip", {}),
    "siglip": (lambda: clip_style("SiglipVisionModel"), "siglip", {}),
    "timm vit, layer scale": (lambda: timm_vit(1e-5), "timm", {}),
    "timm vit": (lambda: timm_vit(None), "timm", {}),
}
if importlib.util.find_spec("open_clip") is not None:
    MODELS["open_clip vit, layer scale"] = (open_clip_vit, "open_clip", {})


def call(model: nn.Module, adapter: str, x: torch.Tensor) -> torch.Tensor:
    if adapter in ("timm", "open_clip"):
        return model(x)
    return model(pixel_values=x).last_hidden_state


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The norm kind of each call of the fused kernel during the test."""
    calls: list[str] = []
    launch = kernel.add_norm

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[-1])
        return launch(*args)

    monkeypatch.setattr(kernel, "add_norm", counted)
    yield calls


def rewritten(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_rewritten_layers_equal_the_model(
    name: str, dtype: torch.dtype, kernel_calls: list[str]
) -> None:
    build, adapter, options = MODELS[name]
    torch.manual_seed(0)
    model = build().to(dtype).eval()
    inputs = {batch: torch.randn(batch, 3, IMAGE, IMAGE, dtype=dtype) for batch in (1, 3)}
    with torch.inference_mode():
        expected = {batch: call(model, adapter, x) for batch, x in inputs.items()}
        graphed = layergraph.wrap(
            model,
            adapter=adapter,
            backend=SimulatedGraphs(),
            batch_sizes=[1, 4],
            fuse_norm=True,
            **options,
        )
        layers = graphed.plan.layers()
        kinds = [
            "rms_norm"
            if "RMSNorm" in type(getattr(layer, "layernorm_after", None)).__name__
            else "layer_norm"
            for layer in layers
        ]
        for batch, x in inputs.items():
            got = call(graphed, adapter, x)
            assert relative_error(got, expected[batch]) <= DEFAULT_TOLERANCE[dtype]
        assert graphed.stats.replays == 2
        assert kernel_calls[-len(layers) :] == kinds
        with graphed.original() as original:
            assert torch.equal(call(original, adapter, inputs[1]), expected[1])
    first_too = {"rms_norm": ", first norm through another", "layer_norm": ""}
    assert [c for c in graphed.changes if "fuse_norm" in c] == [
        f"{path}: residual adds and second norm through one kernel{first_too[kind]} (fuse_norm)"
        for kind, (path, module) in zip(
            kinds, ((p, m) for p, m in model.named_modules() if any(m is x for x in layers))
        )
    ]
    own = {id(layer): type(layer).forward for layer in layers}
    graphed.unwrap()
    assert rewritten(model) == []
    assert all(type(layer).forward is own[id(layer)] for layer in layers)
    with torch.inference_mode():
        assert torch.equal(call(model, adapter, inputs[3]), expected[3])


def test_other_rewrites_combine_with_fuse_norm(kernel_calls: list[str]) -> None:
    """fuse_qkv, patch_matmul and the Triton attention kernel stay in place inside the layers
    fuse_norm rewrites."""
    torch.manual_seed(0)
    model = internvit("layer_norm").eval()
    x = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        expected = call(model, "internvl", x)
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            backend=SimulatedGraphs(),
            attention="triton",
            fuse_qkv=True,
            patch_matmul=True,
            fuse_norm=True,
        )
        got = call(graphed, "internvl", x)
    assert relative_error(got, expected) <= DEFAULT_TOLERANCE[torch.float32]
    # per forward: each layer's second norm, and each layer's first norm but the first's,
    # computed with the residual add before it
    per_forward = 2 * len(graphed.plan.layers()) - 1
    assert kernel_calls and set(kernel_calls) == {"layer_norm"}
    assert len(kernel_calls) % per_forward == 0
    assert graphed.plan.attention_by_key  # the Triton attention backend served the graph
    assert sum("fuse_qkv" in change for change in graphed.changes) == 2
    graphed.unwrap()
    assert rewritten(model) == []


def test_training_and_gradient_calls_run_the_layers_own_forward(kernel_calls: list[str]) -> None:
    torch.manual_seed(0)
    model = timm_vit(1e-5).eval()
    x = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.no_grad():
        expected = model(x)
    graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), fuse_norm=True)
    assert torch.equal(graphed(x), expected)  # gradients enabled: eager, the layers' own forward
    model.train()
    with torch.no_grad():
        graphed(x)
    assert kernel_calls == []
    model.eval()
    with torch.no_grad():
        graphed(x)
    assert kernel_calls and set(kernel_calls) == {"layer_norm"}


def test_layers_and_norms_not_served_are_refused() -> None:
    eva = timm.create_model("eva02_tiny_patch14_224", img_size=IMAGE, depth=1).eval()
    with pytest.raises(ValueError, match=r"declares their form.*; EvaBlock is not one"):
        layergraph.wrap(eva, adapter="timm", backend=SimulatedGraphs(), fuse_norm=True)
    assert rewritten(eva) == []
    model = timm_vit(None).eval()
    model.blocks[1].norm2.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="does not combine with hooks on them"):
        layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), fuse_norm=True)
    assert rewritten(model) == []
    grouped = copy.deepcopy(timm_vit(None))
    grouped.blocks[0].norm2 = nn.GroupNorm(1, 72)
    with pytest.raises(ValueError, match="second norm is GroupNorm"):
        FusedAddNorm(grouped.blocks[0])
    with pytest.raises(ValueError, match="fuse_norm='yes': choose False or True"):
        fused_norms(list(model.blocks), "yes")  # type: ignore[arg-type]
    assert fused_norms(list(eva.blocks), False) == []


def test_refused_where_triton_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    model = internvit("rms_norm").eval()
    with pytest.raises(ValueError, match=r"needs a CUDA device .* the model is on cpu"):
        layergraph.wrap(model, adapter="internvl", backend=SimulatedGraphs(), fuse_norm=True)
    assert rewritten(model) == []


def test_compiled_layers_keep_the_kernel_as_one_operator(kernel_calls: list[str]) -> None:
    """With compile_layers, Dynamo traces the rewritten layer and keeps the launch as the
    operator ``layergraph.add_norm``, once per layer graph."""
    torch.manual_seed(0)
    model = internvit("rms_norm").eval()
    x = torch.randn(2, 3, IMAGE, IMAGE)
    traced: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, _: Any) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        expected = call(model, "internvl", x)
        graphed = layergraph.wrap(
            model,
            adapter="internvl",
            attention="sdpa",
            fuse_norm=True,
            compile_layers={"backend": recording_backend},
            backend=SimulatedGraphs(),
        )
        got = call(graphed, "internvl", x)
        graphed.unwrap()
    assert relative_error(got, expected) <= DEFAULT_TOLERANCE[torch.float32]
    assert "layergraph.add_norm" in traced
    assert not any("triton_kernel_wrapper" in target for target in traced)
    assert kernel_calls and set(kernel_calls) == {"rms_norm"}


def test_a_layer_given_other_states_than_those_handed_over_norms_them_itself() -> None:
    """A forward hook that replaces a layer's output: the next layer's first norm is computed
    from what it is given, not taken from the layer before."""
    torch.manual_seed(0)
    model = timm_vit(0.5).eval()
    model.blocks[0].register_forward_hook(lambda module, args, out: out * 0.5 + 1.0)
    x = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        expected = model(x)
        graphed = layergraph.wrap(model, adapter="timm", backend=SimulatedGraphs(), fuse_norm=True)
        got = graphed(x)
    assert relative_error(got, expected) <= DEFAULT_TOLERANCE[torch.float32]
    graphed.unwrap()
