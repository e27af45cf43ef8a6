"""Warm starts: what compiling cost one process, saved to a file and loaded by the next.

The speed options that compile (``compile_layers``, ``compile_region``) spend seconds to
minutes in Inductor for each shape. Inductor caches what it compiled on the local disk, so a
second process on the same machine starts faster; a replica starting on a new machine does
not have that cache. :func:`save_warm_start` writes Inductor's cache artifacts of this process
(``torch.compiler.save_cache_artifacts``) to one file, with the GPU and the versions they were
made with; :func:`load_warm_start` (or ``wrap(..., warm_start=path)``) loads them in another
process before anything compiles, so compiling finds its results in the cache.

Artifacts are only good for the same GPU model and the same torch, Triton and CUDA versions:
a file made elsewhere is not loaded, with a :class:`WarmStartMismatch` warning saying what
differs, and compiling runs cold.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .warn import warn

__all__ = ["WarmStartMismatch", "load_warm_start", "save_warm_start", "warm_start_origin"]

_MAGIC = b"layergraph warm start 1\n"


class WarmStartMismatch(UserWarning):
    """A warm-start file was made on another GPU or with other versions; it was not loaded."""


def warm_start_origin() -> dict[str, str]:
    """What artifacts made in this process depend on: the device and the versions."""
    from . import __version__

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _installed("triton"),
        "layergraph": __version__,
    }


def _installed(distribution: str) -> str:
    """The installed version of ``distribution``, without importing it; ``"none"``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def save_warm_start(path: str | os.PathLike[str]) -> int:
    """Write Inductor's cache artifacts of this process to ``path``; returns their bytes.

    Raises ``RuntimeError`` if nothing was compiled in this process yet (compile first:
    capture the shapes a replica will serve).
    """
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None or not artifacts[0]:
        raise RuntimeError(
            "nothing was compiled in this process: capture the shapes to save with "
            "compile_layers or compile_region first"
        )
    data = artifacts[0]
    header = json.dumps({"origin": warm_start_origin()}).encode()
    Path(path).write_bytes(_MAGIC + header + b"\n" + data)
    return len(data)


def load_warm_start(path: str | os.PathLike[str]) -> bool:
    """Load a file written by :func:`save_warm_start` into Inductor's caches.

    Returns whether it was loaded: a file made on another GPU or with other versions is not,
    with a :class:`WarmStartMismatch` warning naming what differs. Raises ``ValueError`` for a
    file that is not a warm-start file.
    """
    origin, data = _read(Path(path))
    here = warm_start_origin()
    differences = [
        f"{name} {origin.get(name)!r} here {value!r}"
        for name, value in here.items()
        if name != "layergraph" and origin.get(name) != value
    ]
    if differences:
        warn(
            f"warm start {path} was made elsewhere ({'; '.join(differences)}); not loaded, "
            f"compiling runs cold",
            WarmStartMismatch,
        )
        return False
    torch.compiler.load_cache_artifacts(data)
    return True


def _read(path: Path) -> tuple[dict[str, Any], bytes]:
    content = path.read_bytes()
    if not content.startswith(_MAGIC):
        raise ValueError(f"{path} is not a layergraph warm-start file")
    header, _, data = content[len(_MAGIC) :].partition(b"\n")
    try:
        origin = json.loads(header)["origin"]
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path}: its header cannot be read ({error})") from None
    return origin, data
