"""align_mlp: an MLP's hidden width padded with zeros to a multiple of 64, through the ledger.

On the CPU in float32: the padded MLP must equal the module's own forward within 1e-5
relative error on fresh random inputs (only the products' summation order differs), and the
Qwen2.5-VL tower wrapped with ``align_mlp=True`` must equal the unwrapped tower within the
qwen2_vl tests' 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from packaging.specifiers import SpecifierSet
from torch import nn

import layergraph
from layergraph.ledger import ChangeLedger
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error
from layergraph_adapters.kit.aligned_mlp import AlignedForward, AlignedMLP
from layergraph_adapters.qwen2_vl import QWEN_SUPPORT

TOLERANCE = 1e-5


class GatedMLP(nn.Module):
    """Qwen2.5-VL's vision MLP, in miniature."""

    def __init__(self, width: int = 16, hidden: int = 20, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=bias)
        self.up_proj = nn.Linear(width, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, width, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen2-VL's ``VisionMlp``, in miniature."""

    def __init__(self, width: int = 16, hidden: int = 36) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def aligned(module: nn.Module) -> tuple[AlignedMLP, ChangeLedger]:
    ledger = ChangeLedger(module)
    alignment = AlignedMLP(module)
    ledger.apply(alignment)
    ledger.apply(AlignedForward(alignment))
    return alignment, ledger


@pytest.mark.parametrize("module", [GatedMLP(), GatedMLP(bias=False), PlainMLP()])
def test_the_padded_mlp_equals_the_modules_own(module: nn.Module) -> None:
    torch.manual_seed(1)
    module.eval()
    x = torch.randn(5, 7, 16)
    want = module(x)
    parameters = dict(module.named_parameters())
    alignment, ledger = aligned(module)
    assert alignment.padded == 64
    assert alignment.up_weight.shape[0] == 64 * (2 if isinstance(module, GatedMLP) else 1)
    assert relative_error(module(x), want) <= TOLERANCE
    assert dict(module.named_parameters()) == parameters  # the same Parameter objects
    state = module.state_dict()
    assert all(torch.equal(state[name], p) for name, p in parameters.items())
    hidden = torch.randn(3, 16)
    with torch.no_grad():  # the module's own forward on the padded views
        assert relative_error(type(module).forward(module, hidden), module(hidden)) <= TOLERANCE
    ledger.undo_all()
    assert "forward" not in vars(module)
    assert all(p.is_contiguous() for p in module.parameters())
    assert relative_error(module(x), want) <= TOLERANCE


def test_in_place_updates_and_moves_reach_the_padded_weights() -> None:
    torch.manual_seed(2)
    module = GatedMLP().eval()
    alignment, ledger = aligned(module)
    x = torch.randn(4, 16)
    with torch.no_grad():
        module.up_proj.weight.mul_(-2.0)
        module.down_proj.weight.add_(0.5)
    with ledger.suspended():
        want = module(x)
    assert relative_error(module(x), want) <= TOLERANCE
    module.double()  # new storage for every parameter
    alignment.refresh()
    assert alignment.up_weight.dtype == torch.float64
    assert relative_error(module(x.double()), want.double()) <= TOLERANCE


def test_an_aligned_width_or_another_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="hidden width 64 is already a multiple of 8"):
        AlignedMLP(GatedMLP(hidden=64))
    with pytest.raises(ValueError, match="Linear has none of them"):
        AlignedMLP(nn.Linear(4, 4))


def test_training_calls_run_the_modules_own_forward() -> None:
    module = GatedMLP()
    aligned(module)
    module.train()
    x = torch.randn(2, 16, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and module.gate_proj.weight.grad is not None


transformers = pytest.importorskip("transformers")
served = SpecifierSet(QWEN_SUPPORT.checked).contains(transformers.__version__, prereleases=True)


def qwen25_tower() -> nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=52,  # not a multiple of 8, as Qwen2.5-VL's 3420
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        out_hidden_size=32,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VisionTransformerPretrainedModel(config).eval()


@pytest.mark.skipif(not served, reason=f"the qwen2_vl adapter needs {QWEN_SUPPORT.checked}")
def test_qwen25_tower_with_align_mlp_equals_its_own_and_unwraps() -> None:
    model = qwen25_tower()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    graphed = layergraph.wrap(
        model,
        adapter="qwen2_vl",
        backend=SimulatedGraphs(),
        observe_calls=0,
        align_mlp=True,
        budget_step=32,
    )
    assert graphed.speed_options["align_mlp"] == "on"
    assert sum("align_mlp" in line for line in graphed.changes) == 2 * len(model.blocks)
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    for _ in range(2):
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
        with torch.inference_mode():
            got = graphed(pixels, grid_thw=grid).pooler_output
            with graphed.original():
                want = model(pixels, grid_thw=grid).pooler_output
        assert relative_error(got, want) <= 1e-4
    assert graphed.stats.replays >= 1
    graphed.unwrap()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.skipif(not served, reason=f"the qwen2_vl adapter needs {QWEN_SUPPORT.checked}")
def test_align_mlp_auto_is_off_on_the_cpu_with_the_reason() -> None:
    graphed = layergraph.wrap(
        qwen25_tower(), adapter="qwen2_vl", backend=SimulatedGraphs(), observe_calls=0
    )
    assert graphed.speed_options["align_mlp"].startswith("off: the model is on cpu")
