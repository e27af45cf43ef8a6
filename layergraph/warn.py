"""Warnings that name the user's line, not the line inside layergraph that noticed the problem.

A call reaches layergraph's warnings through frames of layergraph, its adapters, PyTorch's
module machinery and transformers; how many depends on the path (a forward, a capture, a
compiled layer), so no fixed ``stacklevel`` is right. :func:`warn` counts the frames instead.
``warnings.warn``'s ``skip_file_prefixes`` (Python 3.12) would do the same by file name, but
layergraph supports Python 3.10.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType

__all__ = [
    "INTERNAL_PACKAGES",
    "LayergraphDeprecationWarning",
    "moved_module",
    "user_stacklevel",
    "warn",
]


class LayergraphDeprecationWarning(FutureWarning):
    """A name or form of layergraph's API or plugin API that a later release removes; the
    message names the old form, the new one and the release that removes it. A
    ``FutureWarning``, which Python shows by default (a ``DeprecationWarning`` is hidden outside
    ``__main__`` and test runners), so whoever runs a script, a service or a plugin sees it."""


INTERNAL_PACKAGES: tuple[str, ...] = (
    "layergraph",
    "layergraph_adapters",
    "pluggy",
    "torch",
    "transformers",
)
"""Packages whose frames a warning skips: the first frame of any other module is the user's."""


def _internal(module_name: str) -> bool:
    return any(
        module_name == package or module_name.startswith(package + ".")
        for package in INTERNAL_PACKAGES
    )


def _importing(frame: FrameType) -> bool:
    """Whether ``frame`` is the import system's, which ``warnings`` skips when it counts a
    ``stacklevel`` (a warning raised while a module is imported names the importing line)."""
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller of this function name
    the first frame outside :data:`INTERNAL_PACKAGES` and the import system (the outermost
    frame if there is none).
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and (
        _internal(frame.f_globals.get("__name__", "")) or _importing(frame)
    ):
        frame = frame.f_back
        if not _importing(frame):
            level += 1
    return level


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)``, attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def moved_module(old: str, new: str, since: str = "0.2.0", until: str = "0.3") -> None:
    """Make the module being imported as ``old`` the module ``new`` (the same object, so
    everything it holds is reachable by the old path), with a ``LayergraphDeprecationWarning``
    naming the importing line. Called by the body of a module that moved."""
    sys.modules[old] = importlib.import_module(new)
    warn(
        f"{old} is {new} since layergraph {since}; the old path goes in {until}",
        LayergraphDeprecationWarning,
    )
