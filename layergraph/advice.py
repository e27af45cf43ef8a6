"""What ``adapter="auto"`` says when no adapter serves a model: why, and what would serve.

Advice that leads to a refusal or a wrong answer is worse than none, so it names only what an
adapter recognises: a part of the model that a dedicated adapter serves, with the line that
wraps it; else, where the model holds a list of like layers, the ``sequential`` adapter on it,
with the check it makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["refusal"]


Recognize = Callable[[torch.nn.Module], "str | None"]
"""The name of the dedicated adapter that serves a module, or ``None``."""


def refusal(model: torch.nn.Module, recognize: Recognize, adapters: Sequence[str]) -> str:
    """Why no adapter of ``adapters`` serves ``model``, and what would be served:
    ``recognize`` finds the dedicated adapter of a part, if one serves it."""
    message = (
        f"no adapter recognises {type(model).__module__}.{type(model).__qualname__}: none of "
        f"the installed adapters knows where its layers are or how they are called"
    )
    part = served_part(model, recognize)
    if part is not None:
        path, name = part
        message += (
            f"; its part model.{path} is served by the {name} adapter: "
            f"graphed = layergraph.wrap(model.{path})"
        )
    else:
        stack = layer_stack(model)
        if stack is not None:
            message += (
                f"; if its forward applies the layers of model.{stack} one after another to one "
                f"tensor, adapter='sequential', stack={stack!r} graphs them (checked on the "
                f"first call, refused with the reason otherwise)"
            )
    return f"{message}. Adapters installed: {', '.join(adapters) or 'none'}"


def served_part(model: torch.nn.Module, recognize: Recognize) -> tuple[str, str] | None:
    """The shallowest submodule of ``model`` (two levels down at most) that ``recognize``
    names a dedicated adapter for, as ``(path, adapter name)``."""
    parts = [(path, part) for path, part in model.named_modules() if path and path.count(".") <= 1]
    for path, part in sorted(parts, key=lambda item: item[0].count(".")):
        name = recognize(part)
        if name is not None:
            return path, name
    return None


def layer_stack(model: torch.nn.Module) -> str | None:
    """The path of the first ``nn.ModuleList`` in ``model`` of two or more modules of one
    class (a stack of layers), or ``None``."""
    for path, module in model.named_modules():
        layers = module if isinstance(module, torch.nn.ModuleList) else ()
        if len(layers) >= 2 and len({type(layer) for layer in layers}) == 1:
            return path
    return None
