"""Warm starts: what compiling cost one process, saved to a file and loaded by the next.

The speed options that compile (``compile_layers``, ``compile_region``) spend seconds to
minutes in Inductor for each shape. Inductor caches what it compiled on the local disk, so a
second process on the same machine starts faster; a replica starting on a new machine does
not have that cache. :func:`save_warm_start` writes to one file, with the GPU and the versions
they were made with, Inductor's cache artifacts of this process
(``torch.compiler.save_cache_artifacts``: the compiled graphs) and the files this process
wrote into Inductor's and Triton's cache directories (compiled kernels, autotuning results,
and the binaries of Triton kernels outside Inductor, such as layergraph's attention and add-norm
kernels);
:func:`load_warm_start` (or ``wrap(..., warm_start=path)``) puts them back in another process
before anything compiles, so compiling finds its results in the caches instead of compiling
kernels again. Dynamo still traces a compiled region once per shape, and compiled layers once
for every size.

The file also holds the shape policy's measurements (:class:`Measurements`: an eager call and
a replay per batch size, :mod:`layergraph.serving.policy`), for the same model wrapped the same way:
a replica that loads them does not capture, nor compile, the batch sizes whose graphs were
not measured faster than eager, nor measure again those that pay; a packed plan that learns its
token budgets takes them from the calls that process saw, so its first call captures them
instead of being observed eagerly (:mod:`layergraph.serving.budgets`); and what the plan chose by
timing (a packed plan's attention backend per token budget), which the replica's plan takes
instead of timing again.

Artifacts are only good for the same GPU model and the same torch, Triton and CUDA versions:
a file made elsewhere is not loaded, with a :class:`WarmStartMismatch` warning saying what
differs, and compiling runs cold.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import sys
import tarfile
import time
from collections.abc import Hashable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .serving.policy import Costs
from .version import __version__
from .warn import warn

__all__ = [
    "Measurements",
    "WarmStartMismatch",
    "load_warm_start",
    "read_measurements",
    "save_warm_start",
    "warm_start_origin",
]

_MAGIC = b"layergraph warm start 2\n"

_STARTED = time.time() - 1.0
"""Files of the cache directories modified after this belong to this process's compiling."""


class WarmStartMismatch(UserWarning):
    """A warm-start file was made on another GPU or with other versions, or its measurements
    for another model; that part of it was not loaded."""


@dataclass(frozen=True)
class Measurements:
    """What the shape policy measured for one wrapped model, by lookup (batch size and call
    signature); for a packed plan learning its budgets, the budgets held and the token totals
    of the calls they were chosen from (token total and calls, :mod:`layergraph.serving.budgets`;
    empty for other plans); and which model that was (a fingerprint of its class, adapter,
    parameters and options: :attr:`layergraph.GraphedModule.fingerprint`)."""

    model: str
    costs: tuple[tuple[Hashable, Costs], ...]
    token_totals: tuple[tuple[int, int], ...] = ()
    token_budgets: tuple[int, ...] = ()
    plan_choices: Any = None
    """What the plan chose by timing (:meth:`~layergraph.adapter.CapturePlan.measured_choices`);
    ``None`` in files written before it was kept."""


def warm_start_origin() -> dict[str, str]:
    """What artifacts made in this process depend on: the device and the versions."""
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


def save_warm_start(path: str | os.PathLike[str], measurements: Measurements | None = None) -> int:
    """Write what this process compiled to ``path`` (Inductor's cache artifacts and the files
    it wrote into Inductor's and Triton's cache directories) and ``measurements``; returns the
    bytes written after the header.

    Raises ``RuntimeError`` if there is nothing to save: nothing compiled in this process yet
    (capture the shapes a replica will serve first) and no measurements.
    """
    artifacts = torch.compiler.save_cache_artifacts()
    data = artifacts[0] if artifacts is not None else b""
    files = _bundle_cache_files()
    measured_any = measurements is not None and (measurements.costs or measurements.token_totals)
    if not data and not files and not measured_any:
        raise RuntimeError(
            "nothing to save: nothing was compiled in this process and nothing measured; "
            "capture the shapes a replica will serve first"
        )
    measured = pickle.dumps(measurements) if measurements is not None else b""
    sections = {"artifacts_bytes": len(data), "files_bytes": len(files)}
    header = json.dumps({"origin": warm_start_origin(), **sections}).encode()
    Path(path).write_bytes(_MAGIC + header + b"\n" + data + files + measured)
    return len(data) + len(files) + len(measured)


def load_warm_start(path: str | os.PathLike[str]) -> bool:
    """Load the compiled part of a file written by :func:`save_warm_start` into Inductor's and
    Triton's caches.

    Returns whether it was loaded: a file made on another GPU or with other versions is not,
    with a :class:`WarmStartMismatch` warning naming what differs. Raises ``ValueError`` for a
    file that is not a warm-start file.
    """
    sections = _read_matching(Path(path))
    if sections is None:
        return False
    artifacts, files, _ = sections
    if artifacts:
        torch.compiler.load_cache_artifacts(artifacts)
    if files:
        _unbundle_cache_files(files)
    return True


def read_measurements(path: str | os.PathLike[str], model: str) -> Measurements | None:
    """The measurements a warm-start file holds for ``model`` (a fingerprint), or ``None``: the
    file holds none, or was made on another GPU or with other versions, or for another model
    (each with a :class:`WarmStartMismatch` warning)."""
    sections = _read_matching(Path(path), warn_elsewhere=False)
    if sections is None or not sections[2]:
        return None
    measurements = pickle.loads(sections[2])
    if measurements.model != model:
        warn(
            f"warm start {path} holds measurements of another model or other options; they "
            f"are not used, each batch size is measured again",
            WarmStartMismatch,
        )
        return None
    return measurements


def _read_matching(path: Path, warn_elsewhere: bool = True) -> tuple[bytes, bytes, bytes] | None:
    """The sections of a warm-start file made on this GPU with these versions, else ``None``
    (with a warning naming what differs, if ``warn_elsewhere``)."""
    origin, sections = _read(path)
    here = warm_start_origin()
    differences = [
        f"{name} {origin.get(name)!r} here {value!r}"
        for name, value in here.items()
        if name != "layergraph" and origin.get(name) != value
    ]
    if differences:
        if warn_elsewhere:
            warn(
                f"warm start {path} was made elsewhere ({'; '.join(differences)}); not "
                f"loaded, compiling runs cold and each batch size is measured again",
                WarmStartMismatch,
            )
        return None
    return sections


def _read(path: Path) -> tuple[dict[str, Any], tuple[bytes, bytes, bytes]]:
    """The origin of a warm-start file, and its sections: Inductor's artifacts, the bundle of
    cache files, the pickled measurements."""
    content = path.read_bytes()
    if not content.startswith(_MAGIC):
        raise ValueError(f"{path} is not a layergraph warm-start file of this version")
    header, _, data = content[len(_MAGIC) :].partition(b"\n")
    try:
        fields = json.loads(header)
        origin = fields["origin"]
        artifacts, files = int(fields["artifacts_bytes"]), int(fields["files_bytes"])
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path}: its header cannot be read ({error})") from None
    return origin, (
        data[:artifacts],
        data[artifacts : artifacts + files],
        data[artifacts + files :],
    )


def _cache_directories() -> dict[str, Path]:
    """The cache directories whose new files a warm start carries, by name: Inductor's, and
    Triton's where Triton is installed (its own, or the one ``TRITON_CACHE_DIR`` names).

    Triton is imported here if it is not yet: a process that loads a warm start has often not
    imported it, and its kernels would otherwise be left out and compiled again.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    directories = {"inductor": Path(cache_dir())}
    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        try:
            from triton import knobs
        except ImportError:  # a Triton too old to have knobs keeps its cache where it likes
            return directories
        directories["triton"] = Path(knobs.cache.dir)
    return directories


def _bundle_cache_files() -> bytes:
    """A tar of the files this process wrote into the cache directories (Triton kernels
    compiled outside Inductor included), or nothing if it wrote none."""
    buffer = io.BytesIO()
    added = 0
    with tarfile.open(fileobj=buffer, mode="w") as bundle:
        for name, directory in _cache_directories().items():
            if not directory.is_dir():
                continue
            for file in sorted(directory.rglob("*")):
                relative = file.relative_to(directory)
                if (
                    file.is_file()
                    and not file.is_symlink()
                    and relative.parts[0] != "locks"
                    and file.stat().st_mtime >= _STARTED
                ):
                    bundle.add(file, arcname=f"{name}/{relative}")
                    added += 1
    return buffer.getvalue() if added else b""


def _unbundle_cache_files(files: bytes) -> None:
    """Write the bundled files into this process's cache directories, keeping those present."""
    directories = _cache_directories()
    with tarfile.open(fileobj=io.BytesIO(files), mode="r") as bundle:
        for member in bundle.getmembers():
            name, _, relative = member.name.partition("/")
            base = directories.get(name)
            if base is None or not member.isfile():
                continue
            target = (base / relative).resolve()
            if not target.is_relative_to(base.resolve()) or target.exists():
                continue
            source = bundle.extractfile(member)
            if source is None:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
            os.chmod(target, member.mode & 0o777)
