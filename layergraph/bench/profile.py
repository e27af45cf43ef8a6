"""Where a call's time goes: its kernels by class, against the floor of its matrix work.

A CUDA graph removes launch gaps and nothing else: inside it run the kernels eager runs. For a
large input the time is in those kernels, and what is worth knowing is how far they are from
what the matrix products and attention alone would take. :func:`profile_call` runs a call a
few times under ``torch.profiler``, sums each kernel's device time per call and sorts the
kernels into classes (:data:`KERNEL_CLASSES`: attention, matrix products, norms, copies,
reductions, elementwise work, other); :func:`flops_by_kind` splits what a ``FlopCounterMode``
counted into matrix products and attention, so that a report can set the busy time against
the time those FLOPs take at the GPU's measured matrix rate.

The host's side: :func:`host_functions` runs a call under ``cProfile`` and returns the Python
functions it spends its host time in, which is where the work before a replay goes when a
waited call is slower than its kernels.

What it does not do: read hardware counters. ``FlopCounterMode`` counts no
FLOPs for a custom kernel (layergraph's Triton attention among them): count them on the eager
call. On the CPU it profiles operators instead of kernels, sorted by the same names.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "KERNEL_CLASSES",
    "CallProfile",
    "HostFunction",
    "KernelClass",
    "flops_by_kind",
    "host_functions",
    "kernel_class",
    "profile_call",
]

KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "varlen", "cudnn_generated", "attn")),
    (
        "matrix products",
        (
            "gemm",
            "cutlass",
            "xmma",
            "nvjet",
            "cublas",
            "wgmma",
            "triton_tem",
            "conv",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::linear",
            "aten::matmul",
        ),
    ),
    ("norms", ("norm",)),
    ("copies", ("copy", "cat", "memcpy", "memset", "transpose", "contiguous", "clone", "index")),
    ("reductions", ("reduce", "softmax", "triton_red", "triton_per", "sum", "mean")),
    (
        "elementwise",
        ("elementwise", "vectorized", "unrolled", "triton_poi", "gelu", "silu", "aten::"),
    ),
)
"""Kernel classes in the order they are tried, each with the (lower-case) substrings of kernel
or operator names that put a kernel in it; a kernel matching none is ``other``. Attention is
tried first (a flash kernel's name may hold a matrix product's), elementwise last (its
patterns are the widest: on the CPU, any other operator)."""

_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "convolution", "_scaled_mm"})
"""The ``FlopCounterMode`` operators counted as matrix products; those whose names hold
``attention`` are attention."""


def kernel_class(name: str) -> str:
    """The class of a kernel (or, on the CPU, an operator) by its name."""
    lowered = name.lower()
    for label, patterns in KERNEL_CLASSES:
        if any(pattern in lowered for pattern in patterns):
            return label
    return "other"


@dataclass
class KernelClass:
    """One class of kernels in a call: device time and kernels per call, and its longest."""

    name: str
    ms: float = 0.0
    kernels: float = 0.0
    longest: list[dict[str, Any]] = field(default_factory=list)
    """The class's longest kernels, longest first: ``{"kernel": name, "ms": per call}``."""


@dataclass
class CallProfile:
    """A call's kernels by class."""

    busy_ms: float
    """The summed device time of the call's kernels (on the CPU, its operators' own time)."""
    kernels: float
    """Kernels per call."""
    classes: list[KernelClass]
    """Kernel classes, longest first."""

    def ms_of(self, name: str) -> float:
        """Milliseconds per call of the class ``name`` (0 where the call has none)."""
        return sum(entry.ms for entry in self.classes if entry.name == name)


def profile_call(
    fn: Callable[[], Any], *, device: torch.device, calls: int = 10, longest: int = 3
) -> CallProfile:
    """Profile ``calls`` calls of ``fn`` after a warm-up call: each kernel's time per call,
    by class, with each class's ``longest`` kernels. ``fn`` may replay a CUDA graph: the
    profiler sees the kernels a replay runs."""
    fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    by_class: dict[str, KernelClass] = {}
    for event in prof.key_averages():
        if not _is_kernel(event, cuda):
            continue
        spent = (event.device_time_total if cuda else event.self_cpu_time_total) / calls / 1e3
        label = kernel_class(event.key)
        entry = by_class.setdefault(label, KernelClass(label))
        entry.ms += spent
        entry.kernels += event.count / calls
        entry.longest.append({"kernel": event.key[:120], "ms": spent})
    for entry in by_class.values():
        entry.longest = sorted(entry.longest, key=lambda item: -item["ms"])[:longest]
    classes = sorted(by_class.values(), key=lambda entry: -entry.ms)
    return CallProfile(
        busy_ms=sum(entry.ms for entry in classes),
        kernels=sum(entry.kernels for entry in classes),
        classes=classes,
    )


@dataclass
class HostFunction:
    """A Python function or builtin that a call spends host time in, per call."""

    name: str
    """``file:line(function)``, the file by its last two path parts, or a builtin's name."""
    calls: float
    own_ms: float
    """Milliseconds in the function itself, not in what it calls."""
    total_ms: float
    """Milliseconds in the function and what it calls."""


def host_functions(
    fn: Callable[[], Any], *, device: torch.device, calls: int = 100, top: int = 20
) -> list[HostFunction]:
    """The ``top`` functions by their own host time over ``calls`` calls of ``fn`` under
    ``cProfile``, after a warm-up call, per call. On a GPU the device is waited for before
    each call, outside the profile, so that a call does not wait for the one before; a wait
    inside ``fn`` counts as host time. ``cProfile`` slows Python's own calls: read the
    shares, not the milliseconds."""
    fn()
    cuda = device.type == "cuda"
    profiler = cProfile.Profile()
    for _ in range(calls):
        if cuda:
            torch.cuda.synchronize(device)
        profiler.enable()
        fn()
        profiler.disable()
    found = [
        HostFunction(_function_name(key), count / calls, own * 1e3 / calls, total * 1e3 / calls)
        for key, (_, count, own, total, _) in pstats.Stats(profiler).stats.items()
        if not key[2].startswith("<method 'disable' of '_lsprof.Profiler'")
    ]
    return sorted(found, key=lambda function: -function.own_ms)[:top]


def _function_name(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":  # a builtin
        return name
    return f"{'/'.join(path.split('/')[-2:])}:{line}({name})"


def flops_by_kind(counter: FlopCounterMode) -> tuple[float, float]:
    """GFLOP of the matrix products and of the attention among what ``counter`` counted
    (``FlopCounterMode`` counts the GPU's attention operators, not the CPU's)."""
    matmul = attention = 0
    for operator, flops in counter.get_flop_counts().get("Global", {}).items():
        parts = str(operator).split(".")  # "aten.addmm", or "aten.addmm.default"
        name = parts[1] if len(parts) > 1 else parts[0]
        if "attention" in name:
            attention += flops
        elif name in _MATMUL_OPS:
            matmul += flops
    return matmul / 1e9, attention / 1e9


def _is_kernel(event: Any, cuda: bool) -> bool:
    """Whether a profiler event is a kernel of the call (on the CPU: an operator's own time)."""
    if cuda:
        return event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0
    return event.key.startswith("aten::") and event.self_cpu_time_total > 0
