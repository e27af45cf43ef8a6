"""Speed options on by default where they fit: the value ``"auto"``, decided in one plan build.

``fuse_qkv``, ``patch_matmul``, ``positions_matmul``, ``fuse_norm``, ``fuse_gelu``,
``align_mlp``, ``fuse_gate`` and ``fuse_rotary`` change a tower's values by rounding only and
take GPU time off every call, graphed or eager; the transformers adapters (every family of
:mod:`layergraph_adapters.towers`, and ``internvl``), ``timm`` and ``open_clip`` default
``fuse_qkv``, ``patch_matmul``, ``fuse_norm`` and ``fuse_gelu`` to ``"auto"``, ``qwen2_vl``
the last five (its ``patch_matmul`` and ``positions_matmul`` take ``"auto"`` and default to
off). Each is declared once as a :class:`SpeedOption` (:data:`SPEED_OPTIONS`): what it
changes, the values it takes, the options it conflicts with and why compiled layers leave it
off.

A plan that takes speed options is built once per ``wrap``, given a :class:`SpeedChoices`
(its ``choices`` keyword): where it would apply an option it calls :meth:`SpeedChoices.take`
with the function that makes the option's rewrite. ``"auto"`` turns into ``True`` when the
tower's parameters are on a CUDA device, no option taken before conflicts, layers compiled
leave it to the plan, and that function makes the rewrite (a ``ValueError`` or
:class:`~layergraph.adapter.AdapterMismatch` from it leaves the option off with the error as
the reason). ``True`` still raises where an option does not fit, and ``False`` turns it off.
What each became is the plan's :attr:`~layergraph.adapter.CapturePlan.speed_options`, shown by
:attr:`GraphedModule.speed_options <layergraph.GraphedModule.speed_options>`; what was
applied is listed in ``graphed.changes`` and undone by ``unwrap()`` like any change.

What this does not do: time the options (they are chosen because they remove work, not by a
measurement on this machine), or decide for a model moved to the GPU after wrapping (the
device at ``wrap`` decides; wrap the model where it will run).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from layergraph.adapter import AdapterMismatch, CapturePlan, PlanContext
from layergraph.warn import LayergraphDeprecationWarning

__all__ = [
    "AUTOMATIC_OPTIONS",
    "SPEED_OPTIONS",
    "OptionDoesNotApply",
    "SpeedChoices",
    "SpeedOption",
    "build_with_automatic_options",
    "not_on_a_gpu",
]


class OptionDoesNotApply(AdapterMismatch, ValueError):
    """A speed option asked for with ``True`` that the tower's family record rules out. Both an
    :class:`~layergraph.adapter.AdapterMismatch` and a ``ValueError``, as the refusals of the
    plans that decided it before the records did were one or the other."""


@dataclass(frozen=True)
class SpeedOption:
    """One speed option: what it changes and how it combines with the others.

    It is not the rewrite itself: the plan that applies the option makes that, through
    :meth:`SpeedChoices.take`.
    """

    name: str
    change: str
    """What the option rewrites, in a phrase."""
    values: tuple[object, ...] = (True, False, "auto")
    """The values it takes."""
    compiled: str | None = None
    """Why compiled layers leave it off (``"auto"``), or ``None`` where they do not."""
    conflicts: tuple[str, ...] = ()
    """The options that rewrite the same modules: of two asked, the one decided first wins."""

    def check(self, value: object) -> None:
        """Raise a ``ValueError`` naming the choices where ``value`` is not one of them."""
        if value in self.values:
            return
        choices = [
            repr(choice) if isinstance(choice, str) else str(choice) for choice in self.values
        ]
        raise ValueError(
            f"{self.name}={value!r}: choose {', '.join(choices[:-1])} or {choices[-1]}"
        )


_MLP = ("fuse_gelu", "align_mlp", "fuse_gate")
SPEED_OPTIONS: Mapping[str, SpeedOption] = {
    option.name: option
    for option in (
        SpeedOption("fuse_qkv", "each layer's q, k and v projections as one product"),
        SpeedOption("patch_matmul", "the patch embedding's convolution as one matrix product"),
        SpeedOption("positions_matmul", "a learned position table resampled by one product"),
        SpeedOption(
            "fuse_norm",
            "each residual add with the next norm as one Triton kernel",
            compiled="torch.compile fuses adds and norms",
        ),
        SpeedOption(
            "fuse_gelu",
            "each MLP's GELU in its up-projection's epilogue",
            values=(True, False, "auto", "approximate"),
            conflicts=("align_mlp", "fuse_gate"),
        ),
        SpeedOption(
            "align_mlp",
            "a gated MLP's width padded to a multiple of 8",
            conflicts=("fuse_gelu",),
        ),
        SpeedOption(
            "fuse_gate",
            "a gated MLP's gate and up as one product, silu(gate) * up as one kernel",
            compiled="torch.compile fuses the gate's activation and product",
            conflicts=("fuse_gelu",),
        ),
        SpeedOption(
            "fuse_rotary",
            "q and k rotated by one Triton kernel",
            compiled="torch.compile fuses the rotation",
        ),
    )
}
"""Every speed option, in the order a plan decides them."""

AUTOMATIC_OPTIONS = tuple(SPEED_OPTIONS)
"""The options whose default is ``"auto"`` in some adapter, in the order they are decided."""

Made = TypeVar("Made")
Plan = TypeVar("Plan", bound=CapturePlan)


class SpeedChoices:
    """The speed options one ``wrap`` asked for, decided while its one plan is built.

    A plan calls :meth:`take` once per option it applies, in :data:`SPEED_OPTIONS`' order;
    options asked for that the plan never takes are off. It does not apply anything: the plan
    keeps what :meth:`take` returns and makes its changes through the ledger later.
    """

    def __init__(
        self,
        module: nn.Module,
        asked: Mapping[str, Any],
        context: PlanContext,
        ruled_out: Mapping[str, str] | None = None,
    ):
        for name, value in asked.items():
            if name in SPEED_OPTIONS:
                SPEED_OPTIONS[name].check(value)
        self.asked = dict(asked)
        self.ruled_out = dict(ruled_out or {})
        """The options the tower's family record rules out, with why
        (:meth:`~layergraph_adapters.kit.family_record.FamilyRecord.ruled_out`): ``"auto"``
        leaves them off with the reason and ``True`` is refused with it, before ``make``."""
        self._elsewhere = not_on_a_gpu(module)
        self._compiled = context.compiled
        self._outcome: dict[str, str] = {}

    def take(self, name: str, make: Callable[[object], Made], off: Made) -> Made:
        """What ``make(value)`` makes for option ``name``, or ``off`` where the option is off.

        ``"auto"`` calls ``make(True)`` where the option may apply and keeps ``off`` with the
        reason where it does not, or where ``make`` refuses with a ``ValueError`` or
        :class:`~layergraph.adapter.AdapterMismatch`; a value asked by hand calls
        ``make(value)`` and lets its refusal raise."""
        option = SPEED_OPTIONS[name]
        if name in self._outcome:
            raise RuntimeError(f"{name} was decided already")
        value = self.asked.get(name, False)
        if value is False:
            self._outcome[name] = "off"
            return off
        if name in self.ruled_out:
            if value != "auto":
                raise OptionDoesNotApply(self.ruled_out[name])
            self._outcome[name] = f"off: {self.ruled_out[name]}"
            return off
        rival = next((other for other in option.conflicts if self.on(other)), None)
        if value == "auto":
            reason = self._why_off(option)
            if reason is None:
                try:
                    made = make(True)
                except (ValueError, AdapterMismatch) as refusal:
                    reason = str(refusal)
                else:
                    if rival is None:
                        self._outcome[name] = "on"
                        return made
                    reason = f"{rival} and {name} both rewrite each block's MLP"
            self._outcome[name] = f"off: {reason}"
            return off
        if rival is not None:
            raise AdapterMismatch(f"{rival} and {name} both rewrite each block's MLP")
        made = make(value)
        self._outcome[name] = "on"
        return made

    def on(self, name: str) -> bool:
        """Whether option ``name`` was decided and taken."""
        return self._outcome.get(name) == "on"

    def outcome(self) -> dict[str, str]:
        """What each option asked for became: ``"on"``, ``"off"``, or ``"off: "`` and why."""
        return {
            name: self._outcome.get(
                name, "off" if self.asked[name] is False else f"off: the plan does not apply {name}"
            )
            for name in SPEED_OPTIONS
            if name in self.asked
        }

    def _why_off(self, option: SpeedOption) -> str | None:
        if self._elsewhere is not None:
            return self._elsewhere
        if option.compiled is not None and self._compiled:
            return f"the layers are compiled, and {option.compiled}"
        return None


def build_with_automatic_options(
    module: nn.Module,
    options: Mapping[str, Any],
    build: Callable[..., Plan],
    context: PlanContext,
    ruled_out: Mapping[str, str] | None = None,
) -> Plan:
    """The plan ``build`` makes for ``module`` with the speed ``options`` asked, built once;
    ``ruled_out``: the options the tower's family record rules out, with why
    (:meth:`~layergraph_adapters.kit.family_record.FamilyRecord.ruled_out`).

    ``build`` takes the :class:`SpeedChoices` as its ``choices`` keyword. A ``build`` that
    takes the options as keywords of their own instead (the form before
    :class:`SpeedChoices`) is built once per ``"auto"`` option to decide it, with a
    ``LayergraphDeprecationWarning``; that form goes in layergraph 0.3. ``build`` must not change
    the model (plans change it later, through the ledger).
    """
    choices = SpeedChoices(module, options, context, ruled_out)
    if _takes_choices(build):
        plan = build(choices=choices)
    else:
        warnings.warn(
            f"{_name_of(build)} takes the speed options as keywords; since layergraph 0.2.0 a "
            f"plan takes one `choices` keyword (layergraph_adapters.kit.automatic."
            f"SpeedChoices) and is built once. The keywords work until layergraph 0.3, one "
            f"trial build per 'auto' option",
            LayergraphDeprecationWarning,
            stacklevel=3,
        )
        plan = _build_by_trials(choices, build)
    plan.speed_options = choices.outcome()
    return plan


def _build_by_trials(choices: SpeedChoices, build: Callable[..., Plan]) -> Plan:
    """The plan of a ``build`` taking each option as a keyword: each ``"auto"`` decided by
    building with it and the options taken before it."""
    settled = {name: (False if value == "auto" else value) for name, value in choices.asked.items()}
    for name in SPEED_OPTIONS:
        if name not in choices.asked:
            continue
        taken = {other: True for other in SPEED_OPTIONS if choices.on(other)}
        trial = {**settled, **taken}
        if choices.asked[name] == "auto":
            choices.take(name, functools.partial(_trial, build, trial, name), None)
        else:
            choices.take(name, lambda value: None, None)
    return build(**{**settled, **{name: True for name in SPEED_OPTIONS if choices.on(name)}})


def _trial(build: Callable[..., Plan], settings: dict[str, Any], name: str, value: Any) -> Plan:
    return build(**{**settings, name: value})


def _takes_choices(build: Callable[..., Any]) -> bool:
    try:
        return "choices" in inspect.signature(build).parameters
    except (TypeError, ValueError):
        return False


def _name_of(build: Callable[..., Any]) -> str:
    function = getattr(build, "func", build)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"


def not_on_a_gpu(module: nn.Module) -> str | None:
    """Why ``module`` is not where the automatic options pay (its parameters on a CUDA
    device), or ``None`` when it is."""
    parameter = next(module.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    return None if device.type == "cuda" else f"the model is on {device}, not a CUDA device"
