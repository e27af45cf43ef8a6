"""Warm starts: what compiling cost one process, saved to a file and loaded by the next.

The speed options that compile (``compile_layers``, ``compile_region``) spend seconds to
minutes in Inductor for each shape. Inductor caches what it compiled on the local disk, so a
second process on the same machine starts faster; a replica starting on a new machine does
not have that cache. :func:`save_warm_start` writes to one file, with the GPU and the versions
they were made with, Inductor's cache artifacts of this process
(``torch.compiler.save_cache_artifacts``: the compiled graphs) and the files this process
wrote into Inductor's and Triton's cache directories (compiled kernels, autotuning results,
and the binaries of Triton kernels outside Inductor, such as layergraph's attention kernel);
:func:`load_warm_start` (or ``wrap(..., warm_start=path)``) puts them back in another process
before anything compiles, so compiling finds its results in the caches instead of compiling
kernels again. Dynamo still traces each compiled region or layer once per shape.

Artifacts are only good for the same GPU model and the same torch, Triton and CUDA versions:
a file made elsewhere is not loaded, with a :class:`WarmStartMismatch` warning saying what
differs, and compiling runs cold.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .warn import warn

__all__ = ["WarmStartMismatch", "load_warm_start", "save_warm_start", "warm_start_origin"]

_MAGIC = b"layergraph warm start 2\n"

_STARTED = time.time() - 1.0
"""Files of the cache directories modified after this belong to this process's compiling."""


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
    """Write what this process compiled to ``path``: Inductor's cache artifacts and the files
    it wrote into Inductor's and Triton's cache directories; returns their bytes.

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
    files = _bundle_cache_files()
    header = json.dumps({"origin": warm_start_origin(), "artifacts_bytes": len(data)}).encode()
    Path(path).write_bytes(_MAGIC + header + b"\n" + data + files)
    return len(data) + len(files)


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
    artifacts, files = data
    torch.compiler.load_cache_artifacts(artifacts)
    _unbundle_cache_files(files)
    return True


def _read(path: Path) -> tuple[dict[str, Any], tuple[bytes, bytes]]:
    """The origin of a warm-start file, its Inductor artifacts and its bundle of cache files."""
    content = path.read_bytes()
    if not content.startswith(_MAGIC):
        raise ValueError(f"{path} is not a layergraph warm-start file of this version")
    header, _, data = content[len(_MAGIC) :].partition(b"\n")
    try:
        fields = json.loads(header)
        origin, size = fields["origin"], int(fields["artifacts_bytes"])
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path}: its header cannot be read ({error})") from None
    return origin, (data[:size], data[size:])


def _cache_directories() -> dict[str, Path]:
    """The cache directories whose new files a warm start carries, by name: Inductor's, and
    Triton's where Triton is loaded (its own, or the one ``TRITON_CACHE_DIR`` names)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    directories = {"inductor": Path(cache_dir())}
    if "triton" in sys.modules:
        from triton import knobs

        directories["triton"] = Path(knobs.cache.dir)
    return directories


def _bundle_cache_files() -> bytes:
    """A tar of the files this process wrote into the cache directories."""
    buffer = io.BytesIO()
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
    return buffer.getvalue()


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
