"""The ledger of model changes: each change undone exactly, and every wrap option undone by
unwrap(), checked over random combinations of options on the CPU.

"Exactly" is checked by a snapshot of the model taken before wrapping and after unwrap(): the
class and instance attributes of every module, its hooks, the identity of every parameter and
buffer, the state_dict's values, and the model's output on a fixed input (equal bit for bit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import layergraph
from layergraph.ledger import (
    AddForwardHook,
    ChangeLedger,
    ReplaceSubmodule,
    SetAttribute,
    SwapClass,
    UndoError,
)
from layergraph.testing import SimulatedGraphs
from layergraph_adapters.kit.fused_norm import fused_norm_unavailable

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@dataclasses.dataclass
class Snapshot:
    """What must come back unchanged after unwrap()."""

    modules: list[tuple[str, type, frozenset[str], tuple[Any, ...]]]
    parameters: list[tuple[str, int, int]]
    buffers: list[tuple[str, int]]
    state: dict[str, torch.Tensor]
    output: torch.Tensor

    @classmethod
    def of(cls, model: nn.Module, call: Callable[[nn.Module], torch.Tensor]) -> Snapshot:
        modules = [
            (
                name,
                type(module),
                frozenset(vars(module)),
                tuple(tuple(map(id, getattr(module, hooks, {}).values())) for hooks in _HOOK_DICTS),
            )
            for name, module in model.named_modules()
        ]
        return cls(
            modules=modules,
            parameters=[(n, id(p), p.data_ptr()) for n, p in model.named_parameters()],
            buffers=[(n, id(b)) for n, b in model.named_buffers()],
            state={k: v.clone() for k, v in model.state_dict().items()},
            output=call(model),
        )

    def assert_same(self, other: Snapshot) -> None:
        assert other.modules == self.modules
        assert other.parameters == self.parameters
        assert other.buffers == self.buffers
        assert other.state.keys() == self.state.keys()
        for key, value in self.state.items():
            assert torch.equal(other.state[key], value), key
        assert torch.equal(other.output, self.output)


# ---- the changes themselves ------------------------------------------------------------------


def test_set_attribute_restores_a_value_or_its_absence() -> None:
    module = nn.Linear(2, 2)
    ledger = ChangeLedger(module)
    ledger.set_forward(module, lambda x: x, "identity")
    ledger.set_attribute(module, "extra", 1, "extra")
    assert module(torch.ones(1, 2)).tolist() == [[1.0, 1.0]]
    module.extra = 2  # changed by someone else while wrapped
    ledger.undo_all()
    assert "forward" not in vars(module) and "extra" not in vars(module)
    holder = type("Holder", (), {})()
    holder.value = "mine"
    ChangeLedger(module).apply(SetAttribute(holder, "value", "wrapped", "x")).undo()
    assert holder.value == "mine"


def test_set_attribute_refuses_parameters_and_submodules() -> None:
    module = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a plain attribute"):
        SetAttribute(module[0], "weight", None, "x")
    with pytest.raises(ValueError, match="not a plain attribute"):
        SetAttribute(module, "0", None, "x")


def test_changes_are_undone_newest_first_and_listed_by_path() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU()]))
    order: list[str] = []

    class Recorded(SetAttribute):
        def undo(self) -> None:
            order.append(self.name)
            super().undo()

    ledger = ChangeLedger(model)
    for name in ("a", "b", "c"):
        ledger.apply(Recorded(model[0], name, 1, f"sets {name}"))
    ledger.swap_class(model[1], type("Sub", (nn.ModuleList,), {}), "class swapped")
    assert ledger.descriptions == ["0: sets a", "0: sets b", "0: sets c", "1: class swapped"]
    ledger.undo_all()
    assert order == ["c", "b", "a"]
    assert type(model[1]) is nn.ModuleList
    assert len(ledger) == 0


def test_a_failing_undo_does_not_stop_the_others() -> None:
    model = nn.Linear(2, 2)

    class Stuck(SetAttribute):
        def undo(self) -> None:
            raise OSError("stuck")

    ledger = ChangeLedger(model)
    ledger.set_attribute(model, "first", 1, "first")
    ledger.apply(Stuck(model, "second", 2, "stuck one"))
    with pytest.raises(UndoError, match="stuck one: OSError: stuck"):
        ledger.undo_all()
    assert "first" not in vars(model)


def test_hooks_class_swaps_and_submodules_come_back() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    original_relu = model[1]
    ledger = ChangeLedger(model)
    ledger.apply(AddForwardHook(model[0], lambda m, i, o: o * 0, "zeroed"))
    assert model(torch.ones(1, 2)).abs().sum() == 0
    with ledger.temporarily(ReplaceSubmodule(model, "1", nn.Identity(), "no relu")):
        assert isinstance(model[1], nn.Identity)
    assert model[1] is original_relu
    with pytest.raises(TypeError, match="not a subclass"):
        SwapClass(model, nn.ModuleList, "x")
    ledger.undo_all()
    assert not model[0]._forward_hooks


def test_suspended_undoes_and_reapplies() -> None:
    model = nn.Linear(2, 2)
    ledger = ChangeLedger(model)
    marker = object()
    ledger.set_attribute(model, "marker", marker, "marked")
    with ledger.suspended():
        assert "marker" not in vars(model)
    assert model.marker is marker and len(ledger) == 1


# ---- fused q/k/v: the same Parameter objects ---------------------------------------------------


def test_fused_qkv_keeps_parameter_objects_and_an_optimizer_made_before_wrap() -> None:
    tower = transformers.SiglipVisionModel(_siglip_config()).eval()
    attention = tower.encoder.layers[0].self_attn
    before = attention.q_proj.weight
    optimizer = torch.optim.SGD(tower.parameters(), lr=0.1)
    graphed = layergraph.wrap(tower, fuse_qkv=True, backend=SimulatedGraphs())
    assert attention.q_proj.weight is before
    with torch.no_grad():
        before.add_(1.0)  # an in-place update while wrapped reaches the fused weight
    fused = graphed.plan.fusions[0].weight
    assert torch.equal(fused[: before.shape[0]], before)
    updated = before.detach().clone()
    model = graphed.unwrap()
    assert model.encoder.layers[0].self_attn.q_proj.weight is before
    assert torch.equal(before, updated)
    assert any(p is before for group in optimizer.param_groups for p in group["params"])


def test_wrap_that_fails_leaves_nothing_behind() -> None:
    tower = transformers.CLIPVisionModel(_clip_config()).eval()
    snapshot = Snapshot.of(tower, _call_tower)
    with pytest.raises(ValueError, match="compile_layers and compile_region"):
        layergraph.wrap(tower, fuse_qkv=True, compile_layers=True, compile_region=True)
    with pytest.raises(ValueError):  # CLIP's quick GELU is refused after q/k/v were fused
        layergraph.wrap(tower, fuse_qkv=True, fuse_gelu=True, backend=SimulatedGraphs())
    snapshot.assert_same(Snapshot.of(tower, _call_tower))


# ---- every option, random combinations ---------------------------------------------------------

IMAGE = 32


def _siglip_config() -> Any:
    return transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
    )


def _clip_config() -> Any:
    return transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=8,
        projection_dim=16,
    )


def _internvl_config() -> Any:
    return transformers.InternVLVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=[IMAGE, IMAGE],
        patch_size=[16, 16],
    )


FUSE_NORM = st.booleans() if fused_norm_unavailable(torch.device("cpu")) is None else st.just(False)
"""fuse_norm where its kernel runs on CPU tensors (Triton's interpreter), else off."""


def _call_tower(model: nn.Module, batch: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.inference_mode():
        out = model(pixel_values=torch.randn(batch, 3, IMAGE, IMAGE))
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def _call_images(model: nn.Module, batch: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.inference_mode():
        return model(torch.randn(batch, 3, IMAGE, IMAGE))


class _LayerListModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _call_rows(model: nn.Module, batch: int = 2) -> torch.Tensor:
    torch.manual_seed(1)
    with torch.inference_mode():
        return model(torch.randn(batch, 8))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], dict[str, Any]]] = {
    "siglip": (
        lambda: transformers.SiglipVisionModel(_siglip_config()),
        _call_tower,
        {
            "fuse_qkv": st.booleans(),
            "patch_matmul": st.booleans(),
            "fuse_gelu": st.sampled_from([False, True]),
            "fuse_norm": FUSE_NORM,
        },
    ),
    "clip": (
        lambda: transformers.CLIPVisionModel(_clip_config()),
        _call_tower,
        {
            "fuse_qkv": st.booleans(),
            "patch_matmul": st.booleans(),
            "feature_layers": st.sampled_from([None, -2, [1, 2]]),
            "fuse_norm": FUSE_NORM,
        },
    ),
    "internvl": (
        lambda: transformers.InternVLVisionModel(_internvl_config()),
        _call_tower,
        {
            "fuse_qkv": st.booleans(),
            "patch_matmul": st.booleans(),
            "fuse_gelu": st.sampled_from([False, "approximate"]),
            "fuse_norm": FUSE_NORM,
            "attention": st.just("sdpa"),
        },
    ),
    "timm": (
        lambda: timm.create_model(
            "vit_tiny_patch16_224",
            img_size=IMAGE,
            num_classes=4,
            class_token=False,
            global_pool="avg",
            depth=2,
        ),
        _call_images,
        {
            "patch_matmul": st.booleans(),
            "fuse_gelu": st.sampled_from([False, "approximate"]),
            "fuse_norm": FUSE_NORM,
        },
    ),
    "sequential": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
        _call_rows,
        {},
    ),
    "sequential-inner": (
        lambda: nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.GELU())),
        _call_rows,
        {"adapter": st.just("sequential"), "stack": st.just("1")},
    ),
    "sequential-stack": (
        _LayerListModel,
        _call_rows,
        {"adapter": st.just("sequential"), "stack": st.just("layers")},
    ),
}


@st.composite
def wrap_options(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(sorted(MODELS)))
    options = {key: draw(strategy) for key, strategy in MODELS[name][2].items()}
    if name != "sequential":
        compiled = draw(st.sampled_from(["none", "layers", "region"]))
        if compiled != "none":
            options[f"compile_{compiled}"] = {"backend": "eager"}
    options["static_output"] = draw(st.booleans())
    options["batch_sizes"] = draw(st.sampled_from([(1, 2, 4), None]))
    return name, options


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(choice=wrap_options(), calls=st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3))
def test_unwrap_gives_back_the_model_as_it_was(
    choice: tuple[str, dict[str, Any]], calls: list[int]
) -> None:
    name, options = choice
    build, call, _ = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    expected = {batch: call(model, batch) for batch in (1, 2, 3)}  # lazy state made here too
    before = Snapshot.of(model, call)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs(), **options)
    for batch in calls:
        torch.testing.assert_close(call(graphed, batch), expected[batch], rtol=1e-2, atol=1e-3)
    with graphed.original() as original:
        assert torch.equal(call(original), before.output)
    call(graphed)
    assert graphed.unwrap() is model
    before.assert_same(Snapshot.of(model, call))


def test_a_collected_wrapper_that_cannot_undo_warns_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No caller is there to take the error of a wrapper's finalizer: it warns instead."""
    from layergraph import module
    from layergraph.ledger import ChangeLedger, UndoError

    def failing(self: ChangeLedger) -> None:
        raise UndoError("could not undo layer: it moved")

    monkeypatch.setattr(ChangeLedger, "undo_all", failing)
    with pytest.warns(UserWarning, match="could not undo its changes to the model: .*moved"):
        module._undo_quietly(ChangeLedger(nn.Linear(2, 2)))
