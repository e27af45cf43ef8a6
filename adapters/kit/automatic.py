"""Speed options on by default where they fit: the value ``"auto"``.

``fuse_qkv``, ``patch_matmul``, ``positions_matmul``, ``fuse_norm``, ``fuse_gelu``,
``align_mlp``, ``fuse_gate`` and ``fuse_rotary`` change a tower's values by rounding only and
take GPU time off every call, graphed or eager; the transformers adapters (every family of
:mod:`layergraph_adapters.towers`, and ``internvl``), ``timm`` and ``open_clip`` default
``fuse_qkv``, ``patch_matmul``, ``fuse_norm`` and ``fuse_gelu`` to ``"auto"``, ``qwen2_vl``
the last five (its ``patch_matmul`` and ``positions_matmul`` take ``"auto"`` and default to
off).
``fuse_gelu`` left to ``"auto"`` takes MLPs whose GELU is the tanh approximation only (the
epilogue's own function); an exact-GELU MLP keeps its GELU unless ``"approximate"`` is asked.
:func:`build_with_automatic_options` turns each ``"auto"`` into ``True`` when the tower's
parameters are on a CUDA device and the plan accepts that option (the family has the
projections, the patch convolution, the layers or the rotation it rewrites, and Triton runs for
the options that launch its kernels), and into ``False`` otherwise, keeping the reason.
``True`` still raises where an option does not fit, and ``False`` turns it off. What each
became is the plan's :attr:`~layergraph.adapter.CapturePlan.speed_options`, shown by
:attr:`GraphedModule.speed_options <layergraph.GraphedModule.speed_options>`; what was
applied is listed in ``graphed.changes`` and undone by ``unwrap()`` like any change.

What this does not do: time the options (they are chosen because they remove work, not by a
measurement on this machine), or decide for a model moved to the GPU after wrapping (the
device at ``wrap`` decides; wrap the model where it will run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from layergraph.adapter import AdapterMismatch, CapturePlan, PlanContext

__all__ = ["AUTOMATIC_OPTIONS", "build_with_automatic_options", "not_on_a_gpu"]

AUTOMATIC_OPTIONS = (
    "fuse_qkv",
    "patch_matmul",
    "positions_matmul",
    "fuse_norm",
    "fuse_gelu",
    "align_mlp",
    "fuse_gate",
    "fuse_rotary",
)
"""The options whose default is ``"auto"`` in some adapter, in the order they are tried."""

_LEFT_TO_THE_COMPILER = {
    "fuse_norm": "torch.compile fuses adds and norms",
    "fuse_gate": "torch.compile fuses the gate's activation and product",
    "fuse_rotary": "torch.compile fuses the rotation",
}
"""The options off with compiled layers, and why: their Triton kernels do elementwise work that
Inductor fuses by itself."""

_OTHER_VALUES = {"fuse_gelu": ("approximate",)}
"""Values an automatic option takes besides ``True``, ``False`` and ``"auto"``."""

Plan = TypeVar("Plan", bound=CapturePlan)


def build_with_automatic_options(
    module: nn.Module,
    options: Mapping[str, Any],
    build: Callable[..., Plan],
    context: PlanContext,
) -> Plan:
    """The plan ``build(**options)`` makes with each ``"auto"`` option resolved for ``module``.

    Each automatic option is tried in :data:`AUTOMATIC_OPTIONS`' order, with those taken before
    it (``build`` with it and them ``True``, the others ``False``), so the plan returned is one
    that was built; a ``ValueError`` or :class:`~layergraph.adapter.AdapterMismatch` from
    ``build`` leaves it off with the error as the reason. ``build`` must not change the model
    (plans change it later, through the ledger).
    """
    for name, value in options.items():
        others = _OTHER_VALUES.get(name, ())
        if name in AUTOMATIC_OPTIONS and value not in (True, False, "auto", *others):
            choices = ["True", "False", "'auto'", *(repr(v) for v in others)]
            raise ValueError(f"{name}={value!r}: choose {', '.join(choices[:-1])} or {choices[-1]}")
    asked = [name for name in AUTOMATIC_OPTIONS if options.get(name) == "auto"]
    settled = {**options, **dict.fromkeys(asked, False)}
    outcome: dict[str, str] = {}
    elsewhere = not_on_a_gpu(module)
    for name in asked:
        if elsewhere is not None:
            outcome[name] = f"off: {elsewhere}"
            continue
        if name in _LEFT_TO_THE_COMPILER and context.compiled:
            outcome[name] = f"off: the layers are compiled, and {_LEFT_TO_THE_COMPILER[name]}"
            continue
        taken = {other: True for other, became in outcome.items() if became == "on"}
        try:
            build(**{**settled, **taken, name: True})
        except (ValueError, AdapterMismatch) as refusal:
            outcome[name] = f"off: {refusal}"
        else:
            outcome[name] = "on"
    chosen = {**settled, **{name: True for name in asked if outcome[name] == "on"}}
    plan = build(**chosen)
    plan.speed_options = {
        name: outcome.get(name, "on" if chosen[name] else "off")
        for name in AUTOMATIC_OPTIONS
        if name in chosen
    }
    return plan


def not_on_a_gpu(module: nn.Module) -> str | None:
    """Why ``module`` is not where the automatic options pay (its parameters on a CUDA
    device), or ``None`` when it is."""
    parameter = next(module.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return None if device.type == "cuda" else f"the model is on {device}, not a CUDA device"
