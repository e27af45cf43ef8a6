"""A module's inference calls computed otherwise while the model is wrapped.

:class:`InferenceForward` is a :class:`~layergraph.ledger.Change`: a plan applies it through
the wrapper's ledger in :meth:`~layergraph.CapturePlan.change_model`, and ``unwrap()`` (or
``GraphedModule.original()``) undoes it. It changes how one module computes, never its
parameters, and what it returns only by rounding. :func:`give_back_storage` is the undo shared
by the changes that do move parameters into a shared tensor (fused q/k/v, padded MLPs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from layergraph.ledger import SetAttribute

__all__ = ["InferenceForward", "give_back_storage"]


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


@torch.no_grad()
def give_back_storage(parameters: Sequence[nn.Parameter], own: Sequence[torch.Tensor]) -> None:
    """Give each of ``parameters`` back the storage it had (``own``, the same order), holding
    the values it holds now: the undo of a change that made parameters views of a shared
    tensor (fused q/k/v, padded MLPs). A parameter moved or converted while changed (its shape,
    dtype or device no longer those of its own storage) gets a contiguous copy instead."""
    for parameter, storage in zip(parameters, own):
        now = parameter.data
        same = (storage.shape, storage.dtype, storage.device) == (now.shape, now.dtype, now.device)
        if same:
            with torch.inference_mode():  # the storage may be an inference tensor
                storage.copy_(now)
            parameter.data = storage
        else:
            parameter.data = now.clone(memory_format=torch.contiguous_format)
