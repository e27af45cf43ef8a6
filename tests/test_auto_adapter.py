"""``adapter="auto"``: every first-party family is recognised, others get a clear error."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from test_internvl_adapter import tiny_vlm, tower  # noqa: E402
from test_pixtral_adapter import tower as pixtral_tower  # noqa: E402
from test_pixtral_adapter import vlm as pixtral_vlm  # noqa: E402
from test_siglip2_adapter import lfm2_vl  # noqa: E402
from test_siglip2_adapter import tower as siglip2_tower  # noqa: E402
from test_siglip_clip_adapters import built, clip_config, siglip_config, tiny_llava  # noqa: E402

import layergraph  # noqa: E402
from layergraph.plugins import AdapterRegistry  # noqa: E402
from layergraph.testing import SimulatedGraphs  # noqa: E402

SMALL_TIMM = {"depth": 1, "embed_dim": 64, "num_heads": 2}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)

MODELS: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    "timm vit": ("timm", lambda: timm.create_model("vit_tiny_patch16_224", **SMALL_TIMM)),
    "timm deit": ("timm", lambda: timm.create_model("deit_tiny_patch16_224", **SMALL_TIMM)),
    "timm eva02": ("timm", lambda: timm.create_model("eva02_tiny_patch14_224", depth=1)),
    "InternVLVisionModel": ("internvl", tower),
    "InternVLForConditionalGeneration": ("internvl", tiny_vlm),
    "InternVLModel": ("internvl", lambda: tiny_vlm().model),
    "SiglipVisionModel": ("siglip", lambda: built(transformers.SiglipVisionModel, siglip_config())),
    "SiglipModel": (
        "siglip",
        lambda: built(
            transformers.SiglipModel,
            transformers.SiglipConfig(text_config=TEXT, vision_config=siglip_config().to_dict()),
        ),
    ),
    "CLIPVisionModel": ("clip", lambda: built(transformers.CLIPVisionModel, clip_config())),
    "CLIPVisionModelWithProjection": (
        "clip",
        lambda: built(transformers.CLIPVisionModelWithProjection, clip_config()),
    ),
    "CLIPModel": (
        "clip",
        lambda: built(
            transformers.CLIPModel,
            transformers.CLIPConfig(text_config=TEXT, vision_config=clip_config().to_dict()),
        ),
    ),
    "LLaVA with CLIP": ("clip", lambda: tiny_llava("clip")),
    "LLaVA with SigLIP": ("siglip", lambda: tiny_llava("siglip")),
    "Siglip2VisionModel": ("siglip2", siglip2_tower),
    "LFM2-VL": ("siglip2", lfm2_vl),
    "Lfm2VlModel": ("siglip2", lambda: lfm2_vl().model),
    "PixtralVisionModel": ("pixtral", pixtral_tower),
    "Mistral3ForConditionalGeneration": ("pixtral", lambda: pixtral_vlm("mistral3")),
    "LLaVA with Pixtral": ("pixtral", lambda: pixtral_vlm("llava")),
    "nn.Sequential": ("sequential", lambda: torch.nn.Sequential(torch.nn.Linear(2, 2))),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_auto_picks_the_adapter_of_each_family(family: str, fresh_registry: None) -> None:
    expected, make = MODELS[family]
    graphed = layergraph.wrap(make())
    assert graphed.adapter.name == expected


def test_unrecognised_model_gets_the_reason_and_the_list(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERGRAPH_DISABLE_PLUGINS", "1")  # first-party adapters only
    with pytest.raises(layergraph.UnknownAdapterError) as error:
        layergraph.wrap(torch.nn.Linear(2, 2))
    message = str(error.value)
    assert "no adapter recognises torch.nn.modules.linear.Linear" in message
    assert "adapter=NAME" not in message and "sequential', stack" not in message
    names = sorted(info.name for info in layergraph.list_adapters() if info.first_party)
    assert {"clip", "qwen2_vl", "sequential", "timm", "whisper"} <= set(names)
    assert ", ".join(names) in message


def test_a_plugin_recognize_hook_comes_first() -> None:
    class Claims:
        @layergraph.hookimpl
        def recognize_model(self, model: torch.nn.Module) -> str | None:
            return "sequential" if isinstance(model, torch.nn.Linear) else None

    registry = AdapterRegistry()
    registry.load_entry_points()
    assert registry.recognize(timm.create_model("vit_tiny_patch16_224", **SMALL_TIMM)) == "timm"
    registry.add_plugin(Claims(), "claims")
    assert registry.recognize(torch.nn.Linear(2, 2)) == "sequential"


def test_plan_part_plans_a_module_inside_the_model_with_the_adapter_auto_chooses() -> None:
    """What a container's adapter asks: the part's adapter and its plan, options passed on."""
    from layergraph.adapter import Adapter, CapturePlan, PlanContext

    seen: dict[str, object] = {}

    class Container(Adapter):
        name = "container"

        def plan(self, model: torch.nn.Module, context: PlanContext) -> CapturePlan:
            adapter, plan = context.plan_part(model[1], {"stack": "0"})
            seen["adapter"] = adapter.name
            return plan

    inner = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    model = torch.nn.Sequential(torch.nn.Identity(), inner)
    graphed = layergraph.wrap(model, adapter=Container(), backend=SimulatedGraphs())
    assert seen["adapter"] == "sequential"
    assert graphed.plan.layers() == list(inner[0])
    graphed.unwrap()
    with pytest.raises(RuntimeError, match="without a part planner"):
        PlanContext(registry=None).plan_part(inner)  # type: ignore[arg-type]
