"""The eager-reason gate: whether a graph may serve a call at all, and if not, why.

Checked on every call, before any lane looks for a graph, so every check is cheap: the
backend's availability, the model's mode, its forward hooks against those graphs are captured
with, the device and dtype of the inputs against the model's, gradients, autocast, an
enclosing capture, and last the plan's own :meth:`~layergraph.adapter.CapturePlan.eager_reason`.
The reason a call runs eagerly is counted in ``stats.eager_calls``, so each is a sentence a
user reads there.

What this module does not do: run anything eagerly or notice moved parameters (the engine
does both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..adapter import CapturePlan
from ..graphs import GraphBackend
from ..guards import GLOBAL_HOOKS, HookWatch
from ..packing import Call
from ..warn import warn

__all__ = ["EagerGate", "EagerModeWarning"]


class EagerModeWarning(UserWarning):
    """The wrapped model's calls run eagerly because of how it is being used (training mode,
    gradients on): warned once per wrapper and cause, where ``stats.eager_calls`` counts
    every such call."""


class EagerGate:
    """Says why a call cannot be served by a graph (a sentence), or ``None`` if it can."""

    def __init__(
        self,
        plan: CapturePlan,
        backend: GraphBackend,
        hooks: HookWatch,
        checks: Sequence[Callable[[], str | None]] = (),
    ) -> None:
        self.plan = plan
        self.backend = backend
        self.hooks = hooks
        self.checks = tuple(checks)
        """Plugins' checks of whether a call must run eagerly now (``eager_check``)."""
        self._unavailable = backend.unavailable_reason()
        self._warned: set[str] = set()
        self.refresh()

    def refresh(self) -> None:
        """Read the model's parameters again (after they moved or were replaced)."""
        self._parameters = tuple(self.plan.owner.parameters())
        self._reference = self._parameters[0] if self._parameters else None

    def reason(self, call: Call) -> str | None:
        """Why ``call`` cannot be served by a graph, or ``None`` if it can. An input unlike
        the model (another device or dtype) comes first, with or without a GPU, so that the
        model's error on it is explained the same everywhere (reasons starting ``input``)."""
        reference = self._reference
        device = reference.device if reference is not None else call.tensors[0].device
        for tensor in call.tensors:
            if tensor.device != device:
                return f"input on {tensor.device}, model on {device}"
            if (
                reference is not None
                and not self.plan.casts_inputs
                and tensor.is_floating_point()
                and reference.is_floating_point()
                and tensor.dtype != reference.dtype
            ):
                return f"input dtype {tensor.dtype} differs from model dtype {reference.dtype}"
        if self._unavailable is not None:
            return self._unavailable
        if self.plan.owner.training:
            return "model is in training mode"
        places = self.hooks.differences()
        if places:
            return hooks_reason(places, self.plan.owner)
        if device.type != self.backend.device_type:
            return f"model is on {device}; graphs need a {self.backend.device_type} device"
        if torch.is_grad_enabled() and (
            any(t.requires_grad for t in call.tensors)
            or any(p.requires_grad for p in self._parameters)
        ):
            return "gradients are enabled (call under torch.inference_mode() or torch.no_grad())"
        if torch.is_autocast_enabled(self.backend.device_type):
            return "autocast is enabled"
        if self.backend.is_capturing():
            return "an enclosing graph capture is running"
        for check in self.checks:
            reason = check()
            if reason is not None:
                self._warn_once(reason)
                return reason
        reason = self.plan.eager_reason(call)
        if reason is not None:
            self._warn_once(reason)
        return reason

    def _warn_once(self, reason: str) -> None:
        """Warn, once per reason, that calls run eagerly for ``reason``, a plugin's or the
        plan's (what the call asks that the graphs do not hold)."""
        if reason in self._warned:
            return
        self._warned.add(reason)
        warn(
            f"calls of the wrapped {type(self.plan.owner).__name__} run eagerly while "
            f"{reason} (stats.eager_calls counts such calls)",
            EagerModeWarning,
        )

    def warn_of_mode(self, call: Call) -> None:
        """Warn (once per cause) when a call runs eagerly because the model is in training
        mode or gradients are on: what a user may not know, and can change."""
        owner = self.plan.owner
        if owner.training:
            cause = "training mode"
            advice = f"call {type(owner).__name__}.eval() (or the wrapper's .eval())"
        elif torch.is_grad_enabled() and (
            any(t.requires_grad for t in call.tensors)
            or any(p.requires_grad for p in self._parameters)
        ):
            cause = "gradients"
            advice = "call it under torch.inference_mode() or torch.no_grad()"
        else:
            return
        if cause in self._warned:
            return
        self._warned.add(cause)
        doing = "is in training mode" if cause == "training mode" else "is called with gradients on"
        warn(
            f"the wrapped {type(owner).__name__} {doing}, so its calls run eagerly and no "
            f"graph serves them; {advice} for graphs (stats.eager_calls counts such calls)",
            EagerModeWarning,
        )


def hooks_reason(places: Sequence[str], owner: nn.Module) -> str:
    """The eager reason of a call while the forward hooks at ``places`` differ from those
    graphs are captured with."""
    named = [
        "all modules (global hooks)"
        if place == GLOBAL_HOOKS
        else place or f"the {type(owner).__name__} itself"
        for place in places
    ]
    listed = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return f"forward hooks changed after wrapping (on {listed}); they run only in eager calls"
