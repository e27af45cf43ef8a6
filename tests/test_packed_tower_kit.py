"""The packed-tower kit's shared pieces: family lookup, argument reading, slots, boundaries,
declared per-call metadata and workspaces. The toy family built from it in the adapter
tutorial runs in ``test_docs.py``."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from layergraph.attention import DenseMaskedAttention, SdpaMaskedAttention, TritonVarlenAttention
from layergraph.attention.layout import AttentionMetadata
from layergraph.keys import UnsupportedCall
from layergraph_adapters.kit.budget_buffers import BudgetBuffers, StagedField, StagedMetadata
from layergraph_adapters.kit.packed_tower import (
    PackedFamily,
    copy_boundaries,
    find_packed_tower,
    host_boundaries,
    image_slots,
    read_inputs,
    workspace,
)


class Tower(nn.Module):
    pass


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.vision = Tower()


def family(**fields: object) -> PackedFamily:
    values = dict(
        module="kit_test_modeling",
        name="Tower",
        holders={Holder.__module__: ("model.vision",)},
        layers="layers",
        attention="attn",
        checked=None,
    )
    return PackedFamily(**{**values, **fields})


def test_a_tower_is_found_by_its_module_once_imported_and_where_its_holders_keep_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lookup = family()
    assert find_packed_tower(Tower(), [lookup]) is None  # its module is not imported
    modeling = types.ModuleType("kit_test_modeling")
    modeling.Tower = Tower
    monkeypatch.setitem(sys.modules, "kit_test_modeling", modeling)
    tower = Tower()
    assert find_packed_tower(tower, [lookup]) == (tower, lookup)
    holder = Holder()
    assert find_packed_tower(holder, [lookup]) == (holder.model.vision, lookup)
    elsewhere = family(holders={"another.module": ("model.vision",)})
    assert find_packed_tower(holder, [elsewhere]) is None  # held by a model not checked
    anywhere = family(holders={"*": ("model.vision",)}, cls=Tower)
    assert find_packed_tower(holder, [anywhere]) == (holder.model.vision, anywhere)


def test_inputs_are_read_by_position_or_keyword_and_other_arguments_named() -> None:
    inputs, options = ("pixels", "sizes"), frozenset({"return_dict"})
    given, rest = read_inputs((1,), {"sizes": 2, "return_dict": False}, inputs, options)
    assert given == {"pixels": 1, "sizes": 2} and rest == {"return_dict": False}
    given, rest = read_inputs((), {"pixels": 1, "use_cache": True}, inputs, options, ["use_cache"])
    assert given == {"pixels": 1} and rest == {}
    with pytest.raises(UnsupportedCall, match="past sizes were passed by position"):
        read_inputs((1, 2, 3), {}, inputs, options)
    with pytest.raises(UnsupportedCall, match="both by position and by keyword"):
        read_inputs((1,), {"pixels": 1}, inputs, options)
    with pytest.raises(UnsupportedCall, match="do not take: output_attentions"):
        read_inputs((1,), {"output_attentions": True}, inputs, options)


def test_slots_round_up_to_powers_of_two_past_the_least() -> None:
    assert [image_slots(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 32]
    assert image_slots(3, minimum=1) == 4


def test_boundaries_leave_the_slots_past_the_images_empty() -> None:
    offsets = host_boundaries([3, 5], 4)
    assert offsets.tolist() == [0, 3, 8, 8, 8] and offsets.dtype == torch.int32
    metadata = AttentionMetadata(
        max_seqlen=8, cu_seqlens=torch.zeros(5, dtype=torch.int32), seq_lens=torch.ones(4).int()
    )
    copy_boundaries(metadata, offsets)
    assert metadata.cu_seqlens.tolist() == [0, 3, 8, 8, 8]
    assert metadata.seq_lens.tolist() == [3, 5, 0, 0]


def test_a_workspace_only_where_a_backend_writes_into_one() -> None:
    like = torch.zeros(1, dtype=torch.bfloat16)
    assert workspace(16, 2, 8, like, SdpaMaskedAttention(), DenseMaskedAttention()) is None
    buffer = workspace(16, 2, 8, like, SdpaMaskedAttention(), TritonVarlenAttention())
    assert buffer.shape == (16, 2, 8) and buffer.dtype == torch.bfloat16


def staged_metadata() -> StagedMetadata:
    fields = (
        StagedField.per_token("positions"),
        StagedField.boundaries(),
        StagedField("order", lambda budget, slots: budget // 2, torch.long, "count"),
        StagedField("grid", lambda budget, slots: slots + 1, torch.long, "ones"),
    )
    first = {
        "positions": torch.zeros(3, 2, dtype=torch.float16),
        "grid": torch.zeros(1, 3, dtype=torch.int32),
    }
    return StagedMetadata.allocate(fields, 8, 4, first, torch.device("cpu"))


def test_declared_fields_are_sized_by_the_budget_and_the_first_calls_values() -> None:
    device = staged_metadata().device
    assert device["positions"].shape == (8, 2) and device["positions"].dtype == torch.float16
    assert device["cu_seqlens"].shape == (5,) and device["cu_seqlens"].dtype == torch.int32
    assert device["order"].shape == (4,) and device["grid"].dtype == torch.long  # declared
    assert device["grid"].shape == (5, 3)


def test_declared_fields_are_written_padded_and_sent_once_per_new_key() -> None:
    staged, made = staged_metadata(), []

    def values(seed: int) -> dict[str, torch.Tensor]:
        made.append(seed)
        generator = torch.Generator().manual_seed(seed)
        return {
            "positions": torch.rand(5, 2, generator=generator).half(),
            "cu_seqlens": torch.tensor([0, 2, 5], dtype=torch.int32),
            "order": torch.tensor([1, 0]),
            "grid": torch.randint(2, 9, (2, 3), generator=generator),
            "unused": torch.ones(1),
        }

    expected = values(7)
    assert staged.load(("a",), lambda: values(7)) and staged.staging.sends == 1
    device = staged.device
    torch.testing.assert_close(device["positions"][:5], expected["positions"])
    assert not device["positions"][5:].any()
    assert device["cu_seqlens"].tolist() == [0, 2, 5, 5, 5]
    assert device["order"].tolist() == [1, 0, 2, 3]
    assert torch.equal(device["grid"][:2], expected["grid"]) and (device["grid"][2:] == 1).all()
    assert not staged.load(("a",), lambda: values(8)) and staged.staging.sends == 1
    assert made == [7, 7]  # the values of a key loaded already are never computed
    assert staged.load(("b",), lambda: values(9)) and staged.staging.sends == 2


def test_loaded_boundaries_reach_the_attention_metadata() -> None:
    metadata = AttentionMetadata(
        max_seqlen=8, cu_seqlens=torch.zeros(5, dtype=torch.int32), seq_lens=torch.ones(4).int()
    )
    buffers = BudgetBuffers(8, torch.zeros(8, 3), metadata, SdpaMaskedAttention(), None)
    assert not buffers.load_staged("a", dict)  # nothing declared: nothing to load
    buffers.staged = staged_metadata()
    values = {
        "positions": torch.ones(3, 2).half(),
        "cu_seqlens": torch.tensor([0, 1, 3], dtype=torch.int32),
        "order": torch.tensor([0]),
        "grid": torch.ones(2, 3, dtype=torch.long),
    }
    assert buffers.load_staged("a", lambda: values)
    assert metadata.cu_seqlens.tolist() == [0, 1, 3, 3, 3]
    assert metadata.seq_lens.tolist() == [1, 2, 0, 0]
