"""Speed options left to ``"auto"`` (the default of fuse_qkv, patch_matmul and fuse_norm):
on where the tower is on a GPU and its plan takes the option, off with the reason otherwise.

On the CPU the GPU check is replaced, so that the options are decided as on a GPU and run
through Triton's interpreter (fuse_norm's kernel); wrapped outputs (simulated graphs) are held
to the dtype's tolerance against the unmodified model, 1e-4 relative in float32.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import layergraph
from layergraph import LayergraphDeprecationWarning
from layergraph.testing import SimulatedGraphs
from layergraph.validation import DEFAULT_TOLERANCE, relative_error
from layergraph_adapters.kit import automatic
from layergraph_adapters.kit.fused_norm import fused_norm_unavailable

transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")
from test_fused_norm import IMAGE, internvit, timm_vit  # noqa: E402


@pytest.fixture
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if fused_norm_unavailable(torch.device("cpu")) is not None:
        pytest.skip("decides fuse_norm through Triton's interpreter")
    monkeypatch.setattr(automatic, "not_on_a_gpu", lambda module: None)


def small(config_class: type) -> object:
    """A two-layer configuration of ``config_class`` for images of ``IMAGE`` pixels."""
    return config_class(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
    )


def dinov2() -> torch.nn.Module:
    return transformers.Dinov2Model(small(transformers.Dinov2Config)).eval()


def check_equal(graphed: layergraph.GraphedModule, model: torch.nn.Module) -> None:
    pixels = torch.randn(2, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        with graphed.original():
            want = model(pixels)
        got = graphed(pixels)
    want = want if isinstance(want, torch.Tensor) else want[0]
    got = got if isinstance(got, torch.Tensor) else got[0]
    assert relative_error(got, want) <= DEFAULT_TOLERANCE[torch.float32]


def test_on_the_cpu_every_automatic_option_is_off_and_says_why() -> None:
    graphed = layergraph.wrap(internvit("layer_norm").eval(), backend=SimulatedGraphs())
    assert graphed.speed_options == {
        "fuse_qkv": "off: the model is on cpu, not a CUDA device",
        "patch_matmul": "off: the model is on cpu, not a CUDA device",
        "fuse_norm": "off: the model is on cpu, not a CUDA device",
        "fuse_gelu": "off: the model is on cpu, not a CUDA device",
    }
    assert not any("fuse_norm" in change or "patch_matmul" in change for change in graphed.changes)


@pytest.mark.usefixtures("as_on_a_gpu")
@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
def test_on_a_gpu_internvit_takes_every_option_and_answers_as_before(norm_type: str) -> None:
    model = internvit(norm_type).eval()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    options = dict(graphed.speed_options)
    assert options.pop("fuse_gelu").startswith("off: InternVLVisionMLP uses the exact (erf) GELU")
    assert options == {"fuse_qkv": "on", "patch_matmul": "on", "fuse_norm": "on"}
    changes = "\n".join(graphed.changes)
    assert "fuse_norm" in changes and "patch_matmul" in changes
    check_equal(graphed, model)
    pixels = torch.randn(1, 3, IMAGE, IMAGE)
    with torch.inference_mode():
        with graphed.original():
            want = model(pixels).last_hidden_state
        graphed.unwrap()
        assert torch.equal(model(pixels).last_hidden_state, want)
    attention = model.encoder.layer[0].attention
    assert attention.q_proj.weight.untyped_storage().nbytes() == attention.q_proj.weight.nbytes


@pytest.mark.usefixtures("as_on_a_gpu")
def test_an_option_a_family_cannot_take_stays_off_with_the_reason() -> None:
    model = dinov2()
    graphed = layergraph.wrap(model, adapter="dinov2", backend=SimulatedGraphs())
    options = graphed.speed_options
    assert options["fuse_qkv"].startswith("off: fuse_qkv is not available for DINOv2")
    assert options["fuse_norm"] == (
        "off: fuse_norm is not available for DINOv2: its record declares no layer form to fuse"
    )
    assert options["patch_matmul"] == "on"
    check_equal(graphed, model)
    with pytest.raises(layergraph.AdapterMismatch, match="fuse_qkv is not available"):
        layergraph.wrap(dinov2(), adapter="dinov2", backend=SimulatedGraphs(), fuse_qkv=True)


@pytest.mark.usefixtures("as_on_a_gpu")
def test_compiled_layers_leave_fuse_norm_to_torch_compile() -> None:
    graphed = layergraph.wrap(
        timm_vit(0.5).eval(), adapter="timm", backend=SimulatedGraphs(), compile_layers=True
    )
    assert graphed.speed_options["fuse_norm"].startswith("off: the layers are compiled")
    assert graphed.speed_options["patch_matmul"] == "on"
    graphed.unwrap()


@pytest.mark.usefixtures("as_on_a_gpu")
def test_options_set_by_hand_are_kept_and_bad_values_refused() -> None:
    graphed = layergraph.wrap(
        timm_vit(None).eval(), adapter="timm", backend=SimulatedGraphs(), fuse_norm=False
    )
    options = dict(graphed.speed_options)
    assert options.pop("fuse_gelu").startswith("off: Mlp uses the exact (erf) GELU")
    assert options == {"patch_matmul": "on", "fuse_norm": "off"}
    graphed.unwrap()
    with pytest.raises(ValueError, match="fuse_norm='yes': choose True, False or 'auto'"):
        layergraph.wrap(timm_vit(None).eval(), adapter="timm", fuse_norm="yes")
    with pytest.raises(ValueError, match="fuse_gelu='yes': choose True, False, 'auto' or 'app"):
        layergraph.wrap(timm_vit(None).eval(), adapter="timm", fuse_gelu="yes")
    graphed = layergraph.wrap(
        timm_vit(None).eval(), adapter="timm", backend=SimulatedGraphs(), fuse_gelu="approximate"
    )
    assert graphed.speed_options["fuse_gelu"] == "on"
    graphed.unwrap()


@pytest.mark.usefixtures("as_on_a_gpu")
def test_a_tanh_gelu_tower_takes_fuse_gelu_and_answers_within_rounding() -> None:
    """SigLIP's MLPs compute the tanh GELU, cuBLASLt's epilogue's own function: on by default
    (off the GPU the same tanh GELU follows the product), outputs within float32's tolerance."""
    model = transformers.SiglipVisionModel(small(transformers.SiglipVisionConfig)).eval()
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    assert graphed.speed_options["fuse_gelu"] == "on"
    assert any("fuse_gelu" in change for change in graphed.changes)
    check_equal(graphed, model)
    graphed.unwrap()


@pytest.mark.usefixtures("as_on_a_gpu")
def test_a_plan_taking_keywords_is_decided_by_trials_with_a_deprecation() -> None:
    """The form before SpeedChoices: each "auto" option decided by a build with those taken
    before it, the plan returned one that was built, and a LayergraphDeprecationWarning."""
    from layergraph.adapter import AdapterMismatch, PlanContext

    built: list[dict[str, object]] = []

    class Plan(layergraph.CapturePlan):
        def __init__(self, **options: object) -> None:
            if options.get("fuse_gelu") and options.get("align_mlp"):
                raise AdapterMismatch("fuse_gelu and align_mlp both rewrite each block's MLP")
            built.append(options)

    with pytest.warns(LayergraphDeprecationWarning, match="takes the speed options as keywords"):
        plan = automatic.build_with_automatic_options(
            torch.nn.Linear(2, 2),
            {"fuse_gelu": "auto", "align_mlp": "auto"},
            Plan,
            PlanContext(registry=None),  # type: ignore[arg-type]
        )
    assert plan.speed_options == {
        "fuse_gelu": "on",
        "align_mlp": "off: fuse_gelu and align_mlp both rewrite each block's MLP",
    }
    assert built[-1] == {"fuse_gelu": True, "align_mlp": False}


@pytest.mark.usefixtures("as_on_a_gpu")
def test_an_option_decided_first_wins_over_a_later_one_that_rewrites_the_same_modules() -> None:
    from layergraph.adapter import AdapterMismatch, PlanContext

    context = PlanContext(registry=None)  # type: ignore[arg-type]
    module = torch.nn.Linear(2, 2)
    choices = automatic.SpeedChoices(module, {"fuse_gelu": "auto", "align_mlp": "auto"}, context)
    assert choices.take("fuse_gelu", lambda setting: ["gelu"], []) == ["gelu"]
    assert choices.take("align_mlp", lambda on: ["aligned"], []) == []
    assert choices.outcome() == {
        "fuse_gelu": "on",
        "align_mlp": "off: fuse_gelu and align_mlp both rewrite each block's MLP",
    }
    by_hand = automatic.SpeedChoices(module, {"fuse_gelu": True, "align_mlp": True}, context)
    by_hand.take("fuse_gelu", lambda setting: ["gelu"], [])
    with pytest.raises(AdapterMismatch, match="fuse_gelu and align_mlp both rewrite"):
        by_hand.take("align_mlp", lambda on: ["aligned"], [])
    with pytest.raises(ValueError, match="align_mlp='on': choose True, False or 'auto'"):
        automatic.SpeedChoices(module, {"align_mlp": "on"}, context)


def _open_clip_vit() -> torch.nn.Module:
    pytest.importorskip("open_clip")
    from test_fused_norm import open_clip_vit

    return open_clip_vit()


def _qwen_tower() -> torch.nn.Module:
    from test_qwen2_vl_streams import model

    return model("qwen2_5_vl")


def _siglip2_tower() -> torch.nn.Module:
    from test_siglip2_adapter import tower

    return tower()


def _tiny_tower(name: str) -> Any:
    from tiny_models import TOWERS

    return TOWERS[name].build


def _tower_names() -> list[str]:
    from tiny_models import TOWERS

    return sorted(TOWERS)


@pytest.mark.usefixtures("as_on_a_gpu")
@pytest.mark.parametrize(
    ("build", "adapter", "options"),
    [
        (lambda: internvit("rms_norm"), "auto", {}),
        (lambda: timm_vit(0.5), "timm", {}),
        (_open_clip_vit, "open_clip", {}),
        (_qwen_tower, "qwen2_vl", {"patch_matmul": "auto", "positions_matmul": "auto"}),
        (_siglip2_tower, "siglip2", {"fuse_norm": "auto", "fuse_gelu": "auto"}),
        *((lambda name=name: _tiny_tower(name)(), "auto", {}) for name in _tower_names()),
    ],
    ids=["internvl", "timm", "open_clip", "qwen2_vl", "siglip2", *_tower_names()],
)
def test_every_first_party_wrap_builds_its_plan_once(
    build: Any, adapter: str | None, options: dict[str, Any]
) -> None:
    """Each "auto" option is decided while the one plan is built: one CapturePlan per wrap."""
    built: list[type] = []

    def count_constructions(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name != "__init__":
            return
        plan = frame.f_locals.get("self")
        caller = frame.f_back
        chained = caller is not None and caller.f_code.co_name == "__init__"
        if isinstance(plan, layergraph.CapturePlan) and not (
            chained and caller.f_locals.get("self") is plan
        ):
            built.append(type(plan))

    model = build().eval()
    sys.setprofile(count_constructions)
    try:
        graphed = layergraph.wrap(model, adapter=adapter, backend=SimulatedGraphs(), **options)
    finally:
        sys.setprofile(None)
    assert len(built) == 1, built
    graphed.unwrap()
