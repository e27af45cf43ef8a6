"""A module's inference calls computed otherwise while the model is wrapped.

:class:`InferenceForward` is a :class:`~layergraph.ledger.Change`: a plan applies it through
the wrapper's ledger in :meth:`~layergraph.CapturePlan.change_model`, and ``unwrap()`` (or
``GraphedModule.original()``) undoes it. It changes how one module computes, never its
parameters, and what it returns only by rounding.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from layergraph.ledger import SetAttribute

__all__ = ["InferenceForward"]


class InferenceForward(SetAttribute):
    """Computes ``module``'s inference calls with :meth:`compute` while applied.

    Training calls run the module's own forward. Subclasses check the module and define
    ``compute``; applying sets the module's ``forward`` on the instance, undoing removes it.
    """

    def __init__(self, module: nn.Module, what: str) -> None:
        own = type(module).forward.__get__(module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if module.training:
                return own(*args, **kwargs)
            return self.compute(*args, **kwargs)

        super().__init__(module, "forward", forward, what)
        self.module = module

    def compute(self, *args: Any, **kwargs: Any) -> Any:
        """What the module returns for an inference call while applied."""
        raise NotImplementedError
