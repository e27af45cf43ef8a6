"""The floating-point operations of one graph's work, counted once per key.

A graph key's FLOPs are counted by running its region once, eagerly, on the key's own buffers
(padding included: what the graph computes) under a dispatch mode that adds up the formulas
of PyTorch's FLOP counter, so that ``stats`` can say what each key costs and, where its replay
was timed, the rate it ran at. Matrix products, convolutions and PyTorch's attention kernels
are counted by PyTorch's formulas; layergraph's varlen attention kernel by
:func:`_varlen_attention_flops` (its sequences' own lengths). Operators without a formula
(other libraries' attention kernels, elementwise work) count nothing, so the count is a floor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_flops", "tflops"]


def count_flops(run: Callable[[], Any]) -> int:
    """The FLOPs ``run()`` performs, counted as it runs (eagerly: compiled code does the same
    work, and Dynamo runs the original code under a dispatch mode)."""
    _register_formulas()
    with _Counter() as counter:
        run()
    return counter.flops


class _Counter(TorchDispatchMode):
    """Adds up the formulas of PyTorch's FLOP counter (``flop_registry``) over the operators
    that run; every operator runs as it would without it. (``FlopCounterMode`` itself also
    tracks modules through autograd hooks, which a call under inference mode does not have.)"""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        # Imported here: PyTorch's FLOP counter imports Triton, which importing layergraph
        # must not (Triton reads its settings, such as its interpreter's, when imported).
        from torch.utils.flop_counter import flop_registry

        self._formulas = flop_registry

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        formula = self._formulas.get(func._overloadpacket)
        if formula is None:
            # Under inference mode composite operators (linear, attention) arrive whole: run
            # what they are made of, whose formulas count.
            with self:
                out = func.decompose(*args, **kwargs)
            return func(*args, **kwargs) if out is NotImplemented else out
        out = func(*args, **kwargs)
        self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def tflops(flops: int, milliseconds: float) -> float:
    """The rate of ``flops`` done in ``milliseconds``, in TFLOP/s."""
    return flops / milliseconds / 1e9


_registered = False


def _register_formulas() -> None:
    """Register the formulas of layergraph's own operators, once (importing the Triton kernel
    module only where it is already imported: no formula is needed for what never ran)."""
    global _registered
    if _registered:
        return
    from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop

    cpu_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if cpu_attention not in flop_registry:  # the CPU's attention kernel, as the GPU's count
        register_flop_formula(cpu_attention, get_raw=True)(sdpa_flop)  # shape-wrapped already

    operator = getattr(getattr(torch.ops, "layergraph", None), "varlen_attention", None)
    if operator is None:
        return
    register_flop_formula(operator, get_raw=True)(_varlen_attention_flops)
    _registered = True


def _varlen_attention_flops(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> int:
    """Two matrix products per head over each sequence's own tokens: ``4 * heads * head_dim *
    sum(length**2)`` (read from the boundaries on the host: counting is not captured)."""
    heads, head_dim = q.shape[1], q.shape[2]
    lengths = seq_lens.to("cpu", torch.int64)
    return int(4 * heads * head_dim * int((lengths * lengths).sum()))
