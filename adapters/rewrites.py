"""What a plan rewrites in a model while it is wrapped.

A rewrite changes how one part of the model computes (a routed forward, a forward hook) without
changing its parameters or what it returns beyond rounding. Plans attach their rewrites when
they route the model to the graphs and detach them when they undo the routing, so eager
comparisons (``GraphedModule.original()``) and ``unwrap()`` see the model as it was.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

__all__ = ["InferenceForward", "Rewrite"]


class Rewrite(Protocol):
    """One part of the model, rewritten while attached; attaching twice changes nothing."""

    def attach(self) -> None: ...

    def detach(self) -> None: ...


class InferenceForward:
    """A rewrite that computes ``module``'s inference calls with :meth:`compute` while attached.

    Training calls run the module's own forward. Subclasses check the module and define
    ``compute``; the module's forward is set on the instance and removed on detaching.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        """What the module returns for an inference call while attached."""
        raise NotImplementedError

    def attach(self) -> None:
        module, compute = self.module, self.compute
        own = type(module).forward.__get__(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if module.training:
                return own(*args, **kwargs)
            return compute(*args, **kwargs)

        module.forward = forward

    def detach(self) -> None:
        self.module.__dict__.pop("forward", None)
