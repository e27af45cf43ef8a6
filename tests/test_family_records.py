"""One record per family: every served family has one, the release table and the options a
family rules out are read from the records, and no adapter names a family's class outside its
record."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import timm
import torch

import layergraph
import layergraph_adapters
from layergraph.testing import SimulatedGraphs
from layergraph_adapters.kit import versions
from layergraph_adapters.kit.automatic import OptionDoesNotApply, SpeedChoices
from layergraph_adapters.kit.family_record import FamilyRecord, family_records
from layergraph_adapters.kit.tower_specs import TowerSpec
from layergraph_adapters.towers import TOWERS

ADAPTERS = Path(layergraph_adapters.__file__).parent


def test_every_family_the_plugins_serve_has_one_record() -> None:
    records = family_records()
    titles = [record.title for record in records]
    assert len(titles) == len(set(titles)), titles
    for spec in TOWERS:
        assert spec in records
    assert {"InternViT", "timm ViT", "open_clip", "PixtralVisionModel", "Siglip2VisionModel"} <= (
        set(titles)
    )
    assert all(isinstance(record, FamilyRecord) for record in records)


def test_the_release_table_is_read_from_the_records() -> None:
    from_records = {r.support.name for r in family_records() if r.support is not None}
    assert set(versions.support_table()) == from_records
    for record in family_records():
        if isinstance(record, TowerSpec):
            assert record.support is versions.TRANSFORMER_TOWERS


def test_a_record_rules_out_options_with_a_reason_naming_option_and_family() -> None:
    for record in family_records():
        for option, reason in record.ruled_out().items():
            assert reason.startswith(f"{option} is not available for {record.title}")
    dinov2 = next(spec for spec in TOWERS if spec.adapter == "dinov2")
    assert set(dinov2.ruled_out()) == {"fuse_qkv", "fuse_norm"}


def test_ruled_out_options_are_off_with_the_reason_or_refused_without_a_build() -> None:
    tower = torch.nn.Linear(2, 2)
    reason = "fuse_norm is not available for Toy: its record declares no layer form to fuse"
    context = layergraph.PlanContext(registry=None)  # type: ignore[arg-type]
    choices = SpeedChoices(tower, {"fuse_norm": "auto"}, context, {"fuse_norm": reason})

    def make(on: object) -> list[object]:
        raise AssertionError("a ruled-out option is not tried")

    assert choices.take("fuse_norm", make, []) == []
    assert choices.outcome() == {"fuse_norm": f"off: {reason}"}
    asked = SpeedChoices(tower, {"fuse_norm": True}, context, {"fuse_norm": reason})
    with pytest.raises(OptionDoesNotApply, match="record declares no layer form") as refusal:
        asked.take("fuse_norm", make, [])
    assert isinstance(refusal.value, ValueError)
    assert isinstance(refusal.value, layergraph.AdapterMismatch)


def test_a_family_without_a_layer_form_refuses_fuse_norm_before_planning() -> None:
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    model = Dinov2Model(config).eval()
    with pytest.raises(ValueError, match="fuse_norm is not available for DINOv2"):
        layergraph.wrap(model, adapter="dinov2", backend=SimulatedGraphs(), fuse_norm=True)
    graphed = layergraph.wrap(model, adapter="dinov2", backend=SimulatedGraphs())  # not held
    assert graphed.speed_options["fuse_norm"].startswith("off: fuse_norm is not available")


def _class_names_as_strings(path: Path) -> list[str]:
    """String constants of ``path`` compared with a class's name (``type(x).__name__ ==``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Attribute) and side.attr == "__name__"
            for side in (node.left, *node.comparators)
        ):
            found += [
                side.value
                for side in (node.left, *node.comparators)
                if isinstance(side, ast.Constant) and isinstance(side.value, str)
            ]
    return found


def test_no_adapter_recognises_a_family_class_by_its_name_outside_a_record() -> None:
    compared = {
        str(path.relative_to(ADAPTERS)): names
        for path in ADAPTERS.rglob("*.py")
        if (names := _class_names_as_strings(path))
    }
    assert compared == {}


def test_the_framework_forms_moved_to_their_families_with_a_warning() -> None:
    from layergraph_adapters import timm_vit
    from layergraph_adapters.kit import fused_norm

    with pytest.warns(layergraph.LayergraphDeprecationWarning, match="timm_vit.TIMM_BLOCK"):
        assert fused_norm.TIMM_BLOCK is timm_vit.TIMM_BLOCK
    block = timm.create_model("vit_tiny_patch16_224", depth=1).blocks[0]
    with pytest.warns(layergraph.LayergraphDeprecationWarning, match="without the layers' form"):
        fused_norm.FusedAddNorm(block)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timm_vit.TIMM_BLOCK.accepts(block)
