"""An MLP's up-projection and GELU as one matrix product with a GELU epilogue.

A transformer MLP computes ``fc2(gelu(fc1(x)))``. Run as written, the GELU is a kernel of its
own that reads and writes the widest activation of the layer; cuBLASLt can apply it while the
product's tile is still in registers (``torch._addmm_activation(..., use_gelu=True)``). On an
H200 that took a fifth off the up-projection with its GELU at batch 32 (InternViT-300M: 0.40
against 0.54 ms per layer) and is never slower at batch 1 (``benchmarks/fusion_candidates.py``).
The GELU is computed in float32 before rounding, where the unfused path rounds the product
first.

cuBLASLt's GELU is the tanh approximation. For MLPs whose activation is that approximation
(SigLIP's ``gelu_pytorch_tanh``) the values are the model's own, up to rounding; for the exact
(erf) GELU of most ViTs the two differ by up to 5e-4 per activation, so :class:`GeluEpilogue`
takes those only when asked (``approximate=True``).

Which GELU a module computes is found by evaluating it on a few points, whatever its class.
Training calls run the MLP's own forward; off the GPU the same tanh GELU follows an unfused
product.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from layergraph_adapters.kit.rewrites import InferenceForward

__all__ = ["GeluEpilogue", "gelu_epilogues", "gelu_kind", "mlp_parts"]

_ACTIVATION_NAMES = ("act", "activation_fn", "act_fn", "gelu")
_UP_NAMES = ("fc1", "c_fc", "linear_fc1")
_DOWN_NAMES = ("fc2", "c_proj", "linear_fc2")
_HARMLESS = (nn.Identity, nn.Dropout)
"""Other children a fusable MLP may have: no-ops at inference (timm's ``drop1``, ``norm``)."""


def gelu_kind(activation: nn.Module) -> Literal["exact", "tanh"] | None:
    """Which GELU ``activation`` computes (``"exact"`` or ``"tanh"``), or ``None`` if neither.

    Decided from its values at points in [-6, 6], computed in float32 on the CPU, once per
    kind of activation: modules of one class without parameters, buffers or children whose
    attributes are equal compute the same function, so a model's 24 or 48 MLPs are probed once.
    """
    key = _probe_key(activation)
    if key is None:
        return _probe(activation)
    if key not in _KINDS:
        _KINDS[key] = _probe(activation)
    return _KINDS[key]


_KINDS: dict[tuple[Any, ...], Literal["exact", "tanh"] | None] = {}
""":func:`gelu_kind`'s answers by :func:`_probe_key`."""


def _probe_key(activation: nn.Module) -> tuple[Any, ...] | None:
    """What determines ``activation``'s function: its class and its attributes, or ``None`` if
    it has parameters, buffers or children (its function could depend on their values) or an
    attribute that cannot be hashed."""
    if any(True for _ in activation.parameters()) or any(True for _ in activation.buffers()):
        return None
    if any(True for _ in activation.children()):
        return None
    settings = tuple(
        sorted(
            (name, value)
            for name, value in vars(activation).items()
            if not name.startswith("_") and name != "training"
        )
    )
    try:
        hash(settings)
    except TypeError:
        return None
    return (type(activation), settings)


def _probe(activation: nn.Module) -> Literal["exact", "tanh"] | None:
    """:func:`gelu_kind` computed: ``activation``'s values against both GELUs'."""
    probe = torch.linspace(-6, 6, 97)
    try:
        with torch.no_grad():
            values = activation(probe)
    except Exception:  # whatever the failure, a module that fails the probe is no GELU
        return None
    if not isinstance(values, torch.Tensor) or values.shape != probe.shape:
        return None
    for kind, approximate in (("exact", "none"), ("tanh", "tanh")):
        if torch.allclose(values, F.gelu(probe, approximate=approximate), rtol=0, atol=1e-6):
            return kind
    return None


def mlp_parts(mlp: nn.Module) -> tuple[nn.Linear, nn.Module, nn.Linear] | None:
    """``(fc1, activation, fc2)`` of an MLP that is ``fc2(activation(fc1(x)))``, else ``None``.

    Accepted: linear ``fc1`` with a bias and ``fc2`` (open_clip's ``c_fc`` and ``c_proj``,
    Qwen3-VL's ``linear_fc1`` and ``linear_fc2``), an activation named ``act``,
    ``activation_fn``, ``act_fn`` or ``gelu``, and no other children but dropouts and
    identities.
    """
    fc1 = next((getattr(mlp, n) for n in _UP_NAMES if hasattr(mlp, n)), None)
    fc2 = next((getattr(mlp, n) for n in _DOWN_NAMES if hasattr(mlp, n)), None)
    names = [name for name in _ACTIVATION_NAMES if isinstance(getattr(mlp, name, None), nn.Module)]
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)) or len(names) != 1:
        return None
    if fc1.bias is None:
        return None
    activation = getattr(mlp, names[0])
    known = {id(fc1), id(fc2), id(activation)}
    if any(id(child) not in known and not isinstance(child, _HARMLESS) for child in mlp.children()):
        return None
    return fc1, activation, fc2


class GeluEpilogue(InferenceForward):
    """Runs ``mlp``'s up-projection and GELU as one product while applied.

    Raises ``ValueError`` if ``mlp`` is not ``fc2(gelu(fc1(x)))`` (see :func:`mlp_parts`), if
    its GELU is the exact one and ``approximate`` is false, or if ``fc1`` has hooks or
    tensor-parallel weights (the product bypasses ``fc1``'s call).
    """

    def __init__(self, mlp: nn.Module, *, approximate: bool = False) -> None:
        parts = mlp_parts(mlp)
        if parts is None:
            raise ValueError(
                f"fuse_gelu needs an MLP of the form fc2(gelu(fc1(x))) with a bias on fc1; "
                f"{type(mlp).__name__} is not"
            )
        kind = gelu_kind(parts[1])
        if kind is None:
            raise ValueError(
                f"fuse_gelu fuses GELU only; {type(mlp).__name__}'s activation is "
                f"{type(parts[1]).__name__}"
            )
        if kind == "exact" and not approximate:
            raise ValueError(
                f"{type(mlp).__name__} uses the exact (erf) GELU and cuBLASLt's epilogue computes "
                f"the tanh approximation; pass fuse_gelu='approximate' to accept it"
            )
        fc1 = parts[0]
        if hasattr(fc1.weight, "to_local") or fc1._forward_hooks or fc1._forward_pre_hooks:
            raise ValueError(
                f"fuse_gelu computes {type(mlp).__name__}.fc1 from its weight and bias directly, "
                f"so it does not combine with tensor-parallel (DTensor) weights or hooks on fc1"
            )
        super().__init__(mlp, "up-projection and GELU as one product (fuse_gelu)")
        self._fc1, _, self._fc2 = parts

    def compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
        fc1 = self._fc1
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rows.is_cuda:
            up = torch._addmm_activation(fc1.bias, rows, fc1.weight.t(), use_gelu=True)
        else:  # the same tanh GELU where there is no cuBLASLt (the CPU's op computes erf)
            up = F.gelu(F.linear(rows, fc1.weight, fc1.bias), approximate="tanh")
        return self._fc2(up.view(*hidden_states.shape[:-1], -1))


def gelu_epilogues(mlps: list[nn.Module], setting: bool | str) -> list[GeluEpilogue]:
    """One :class:`GeluEpilogue` per MLP for an adapter's ``fuse_gelu`` option.

    ``setting`` is ``False`` (none), ``True`` (MLPs whose GELU is the tanh approximation; an
    exact GELU is refused) or ``"approximate"`` (exact-GELU MLPs too, computing the tanh form).
    """
    if setting is not False and setting is not True and setting != "approximate":
        raise ValueError(f"fuse_gelu={setting!r}: choose False, True or 'approximate'")
    if setting is False:
        return []
    return [GeluEpilogue(mlp, approximate=setting == "approximate") for mlp in mlps]
