"""A pre-norm layer's residual adds and its second norm through one Triton kernel (fuse_norm).

A pre-norm transformer layer computes::

    x = x + ls1 * attn(norm1(x))
    x = x + ls2 * mlp(norm2(x))

where ``ls1`` and ``ls2`` are per-channel layer scales (InternViT, timm ViTs built with
``init_values``) or absent (CLIP, SigLIP). Eager PyTorch runs the scale, the residual add and
``norm2`` as separate memory-bound kernels. While applied, :class:`FusedAddNorm` computes a
layer as::

    h = attn(norm1(x))
    x, normed = add_norm(x, h, ls1, norm2)   # one Triton kernel
    x = addcmul(x, mlp(normed), ls2)         # one PyTorch kernel

(:mod:`layergraph.kernels.add_norm`). In a stack of such layers, the last residual add is
computed by the same kernel together with the next layer's ``norm1`` where that is a LayerNorm
or RMSNorm, and the norm is handed over to that layer, which takes it when it is given the
same tensor (else it norms what it is given); the first layer's ``norm1``, where it is one of
transformers' RMSNorm classes (several PyTorch kernels in eager), runs through the kernel's
norm-only path. The attention and the MLP are called as modules, so the other rewrites
(``fuse_qkv``, ``fuse_gelu``, routed attention) still apply to them. Values change by rounding
only: the kernel rounds once where eager rounds after each operation. While ``torch.compile``
traces a layer nothing is handed over (Inductor fuses the add and the norm itself).

Layers served: those whose family's record declares their form (:class:`LayerForm`,
:attr:`FamilyRecord.layer_form <layergraph_adapters.kit.family_record.FamilyRecord.layer_form>`;
CLIP's, SigLIP's, SigLIP2's, InternViT's, the Qwen and GLM towers', timm's ViT blocks and
open_clip's self-attention blocks, whose forms live in their adapters). Norms served:
``nn.LayerNorm``, ``nn.RMSNorm`` and transformers' RMSNorm classes, recognised by what they
compute (:func:`norm_kind`). Dropout and drop path are left out: they do nothing at inference.

A layer's own forward runs instead for training calls, calls with gradients enabled, under
autocast, and for inputs the kernel does not take (a dtype other than float16, bfloat16 and
float32; a CPU tensor outside Triton's interpreter). The kernel needs Triton and a CUDA device
(or ``TRITON_INTERPRET=1`` on the CPU); :func:`fused_norms` refuses the option elsewhere.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from layergraph.warn import LayergraphDeprecationWarning, warn
from layergraph_adapters.kit.rewrites import InferenceForward
from layergraph_adapters.kit.triton_kernels import kernel_takes, triton_unavailable

__all__ = [
    "BLOCK",
    "ENCODER_LAYER",
    "SCALED_LAYER",
    "FusedAddNorm",
    "LayerForm",
    "fused_norm_unavailable",
    "fused_norms",
    "norm_kind",
]


def fused_norm_unavailable(device: torch.device) -> str | None:
    """Why the fused kernel cannot run for a model on ``device``, or ``None`` if it can."""
    return triton_unavailable("fuse_norm", device)


def norm_kind(norm: nn.Module) -> Literal["layer_norm", "rms_norm"] | None:
    """Which norm ``norm`` computes over the last dimension, or ``None`` if not one the kernel
    computes: ``nn.LayerNorm`` (and subclasses, timm's included), ``nn.RMSNorm`` and the
    RMSNorm classes of transformers' models (InternViT-6B's, the Qwen and GLM towers')."""
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) and len(norm.normalized_shape) == 1:
        return "layer_norm" if isinstance(norm, nn.LayerNorm) else "rms_norm"
    return "rms_norm" if _computes_rms_norm(norm) else None


_RMS_PROBES: dict[tuple[type, float, torch.dtype, str], bool] = {}
"""Whether a norm class computes transformers' RMSNorm, by class, epsilon, dtype and device
type, as :func:`_computes_rms_norm` found."""


def _computes_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` computes ``weight * (x * rsqrt(mean(x^2) + variance_epsilon))`` (in
    float32, cast back before the weight), as transformers' RMSNorm classes do: a module
    holding one vector ``weight`` and a ``variance_epsilon``, whose forward is seen to give
    that on a probe, once per class, epsilon, dtype and device type."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.is_meta:
        return False
    if hasattr(weight, "to_local"):  # tensor-parallel: as a plain instance of its class was seen
        return any(probed and kind is type(norm) for (kind, *_), probed in _RMS_PROBES.items())
    if not isinstance(eps, float) or len(list(norm.parameters())) != 1 or list(norm.buffers()):
        return False
    key = (type(norm), eps, weight.dtype, weight.device.type)
    if key not in _RMS_PROBES:
        with torch.no_grad():
            probe = torch.randn(4, weight.shape[0], dtype=weight.dtype, device=weight.device)
            wide = probe.float()
            want = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(
                probe.dtype
            )
            got = type(norm).forward(norm, probe)
        tolerance = 1e-5 if weight.dtype == torch.float32 else 1e-2
        _RMS_PROBES[key] = (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)
        )
    return _RMS_PROBES[key]


def fused_norms(
    layers: list[nn.Module], setting: bool, form: LayerForm | None = None
) -> list[FusedAddNorm]:
    """One :class:`FusedAddNorm` per layer for an adapter's ``fuse_norm`` option, the layers
    of ``form`` (their family's :class:`LayerForm`; ``None`` is deprecated: timm's or
    open_clip's blocks, found by their class, until 0.3).

    Raises ``ValueError`` when a layer is not one served (see the module docstring) or the
    kernel cannot run where the model lives (:func:`fused_norm_unavailable`).
    """
    if setting is not False and setting is not True:
        raise ValueError(f"fuse_norm={setting!r}: choose False or True")
    if not setting:
        return []
    parameter = next((p for layer in layers for p in layer.parameters()), None)
    reason = fused_norm_unavailable(
        parameter.device if parameter is not None else torch.device("cpu")
    )
    if reason is not None:
        raise ValueError(reason)
    rewrites = [FusedAddNorm(layer, form) for layer in layers]
    for rewrite, following in itertools.pairwise(rewrites):
        rewrite.next_layer = following if following.kernel_first_norm() else None
    return rewrites


class FusedAddNorm(InferenceForward):
    """Computes one layer's residual adds and second norm with the fused kernel while applied.

    ``form``: the layer's (its family's :class:`LayerForm`; ``None`` is deprecated: timm's or
    open_clip's block, found by its class, until 0.3). Raises ``ValueError`` for a layer not
    served, a norm the kernel does not compute, hooks on the modules the kernel stands in for
    (the second norm, the layer scales), or tensor-parallel (DTensor) weights there.
    """

    def __init__(self, layer: nn.Module, form: LayerForm | None = None) -> None:
        if form is None:
            form = _framework_form(layer)
        if form is None or not form.accepts(layer):
            raise ValueError(
                f"fuse_norm serves the layers whose family's record declares their form "
                f"(layer_form); {type(layer).__name__} is not one"
            )
        self._call_layer, (first_name, self._norm_name), self._scale_names = (
            form.call,
            form.norms,
            form.scales,
        )
        norm = getattr(layer, self._norm_name)
        kind = norm_kind(norm)
        if kind is None:
            raise ValueError(
                f"fuse_norm computes LayerNorm and RMSNorm; {type(layer).__name__}'s second norm "
                f"is {type(norm).__name__}"
            )
        self._kind: Literal["layer_norm", "rms_norm"] = kind
        scales = [getattr(layer, name) for name in self._scale_names if name is not None]
        replaced = [norm, *(s for s in scales if isinstance(s, nn.Module))]
        if any(m._forward_hooks or m._forward_pre_hooks for m in replaced) or any(
            hasattr(p, "to_local")
            for p in (*scales, *(q for m in replaced for q in m.parameters()))
        ):
            raise ValueError(
                f"fuse_norm computes {type(layer).__name__}'s second norm and layer scales from "
                f"their weights directly, so it does not combine with hooks on them or with "
                f"tensor-parallel (DTensor) weights"
            )
        first = getattr(layer, first_name)
        self._first_kind = _decomposed_rms_norm(first)
        """``"rms_norm"`` where the first norm is an RMSNorm module that eager runs as several
        kernels and the kernel computes alone; ``None``: the module is called."""
        self._first_name = first_name
        self.next_layer: FusedAddNorm | None = None
        """The rewrite of the layer after this one, set by :func:`fused_norms` where that
        layer's first norm is one the kernel computes: this layer's last residual add then
        computes it too, and hands it over (:meth:`add_scaled`)."""
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None
        """The hidden states and their first norm handed over by the layer before."""
        self.own_forward = type(layer).forward.__get__(layer)
        """The layer's own forward, for the calls the kernel does not serve."""
        what = "residual adds and second norm through one kernel"
        if self._first_kind is not None:
            what += ", first norm through another"
        super().__init__(layer, f"{what} (fuse_norm)")

    def compute(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not kernel_takes(hidden_states):
            self._handed = None
            return self.own_forward(hidden_states, *args, **kwargs)
        return self._call_layer(self, hidden_states, *args, **kwargs)

    def kernel_first_norm(self) -> tuple[Literal["layer_norm", "rms_norm"], nn.Module] | None:
        """The first norm's kind and module where the kernel computes that norm (a LayerNorm
        or RMSNorm without hooks or DTensor weights), else ``None``."""
        norm = getattr(self.module, self._first_name)
        kind = norm_kind(norm)
        if kind is None or norm._forward_hooks or norm._forward_pre_hooks:
            return None
        if any(hasattr(p, "to_local") for p in norm.parameters()):
            return None
        return kind, norm

    def first_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's first norm of ``x``: the one the layer before handed over with ``x``
        where it did; an RMSNorm class eager splits into several kernels through the kernel's
        norm-only path; any other norm by calling its module."""
        handed, self._handed = self._handed, None
        if handed is not None and handed[0] is x:
            return handed[1]
        module = getattr(self.module, self._first_name)
        if self._first_kind is None:
            return module(x)
        from layergraph.kernels.add_norm import norm

        return norm(x, module.weight, None, _rms_eps(module, x.dtype), "rms_norm")

    def add_norm(
        self, residual: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + ls1 * h`` and the second norm of it, from the fused kernel."""
        from layergraph.kernels.add_norm import add_norm

        norm = getattr(self.module, self._norm_name)
        eps = _norm_eps(norm, self._kind, residual.dtype)
        return add_norm(
            residual,
            h,
            self._scale(0),
            getattr(norm, "weight", None),
            getattr(norm, "bias", None),
            eps,
            self._kind,
        )

    def add_scaled(self, residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``residual + ls2 * h``; with a :attr:`next_layer` (and not while ``torch.compile``
        traces, which fuses the two itself), computed by the fused kernel together with that
        layer's first norm of it, which is handed over to that layer."""
        from layergraph.kernels.add_norm import add_norm, add_scaled

        following = self.next_layer
        first = following.kernel_first_norm() if following is not None else None
        if first is None or torch.compiler.is_compiling():
            return add_scaled(residual, h, self._scale(1))
        kind, norm = first
        summed, normed = add_norm(
            residual,
            h,
            self._scale(1),
            getattr(norm, "weight", None),
            getattr(norm, "bias", None),
            _norm_eps(norm, kind, residual.dtype),
            kind,
        )
        following._handed = (summed, normed)
        return summed

    def _scale(self, index: int) -> torch.Tensor | None:
        """Layer scale ``index`` (0: after attention, 1: after the MLP) as a vector, or
        ``None``; read at each call, so replaced parameters are followed."""
        name = self._scale_names[index]
        scale = None if name is None else getattr(self.module, name)
        if scale is None or isinstance(scale, nn.Identity):
            return None
        return scale.gamma if isinstance(scale, nn.Module) else scale


def _norm_eps(norm: nn.Module, kind: str, dtype: torch.dtype) -> float:
    """A LayerNorm's or RMSNorm's epsilon for inputs of ``dtype``."""
    return norm.eps if kind == "layer_norm" else _rms_eps(norm, dtype)


def _rms_eps(norm: nn.Module, dtype: torch.dtype) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` in transformers, ``eps`` in torch,
    where ``None`` means the dtype's)."""
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    return torch.finfo(dtype).eps if eps is None else eps


def _decomposed_rms_norm(norm: nn.Module) -> Literal["rms_norm"] | None:
    """``"rms_norm"`` for an RMSNorm class of transformers (written as several PyTorch
    operations, :func:`_computes_rms_norm`) without hooks, DTensor weights or a weight of
    another width; ``None`` otherwise."""
    if isinstance(norm, nn.RMSNorm) or not _computes_rms_norm(norm):
        return None
    weight = getattr(norm, "weight", None)
    if norm._forward_hooks or norm._forward_pre_hooks or hasattr(weight, "to_local"):
        return None
    return "rms_norm" if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


LayerCall = Callable[..., torch.Tensor]
"""A layer's inference call written with :meth:`FusedAddNorm.add_norm` and ``add_scaled``;
it takes the rewrite, then the layer's arguments."""
NormNames = tuple[str, str]
"""The attributes holding a layer's first norm (before attention) and second (before the
MLP)."""
ScaleNames = tuple[str | None, str | None]
"""The attributes holding a layer's two layer scales (a vector parameter, a ``LayerScale``
or an ``Identity``), ``None`` for a layer without."""


@dataclass(frozen=True)
class LayerForm:
    """How a family's pre-norm layer computes, for ``fuse_norm``: its call written with the
    kernel, where its norms and layer scales live, and which layers have the form.

    A family's record declares its layers' form
    (:attr:`~layergraph_adapters.kit.family_record.FamilyRecord.layer_form`). A layer of a
    form computes ``x + ls1 * attn(norm1(x))`` and then ``x + ls2 * mlp(norm2(x))`` with the
    attribute names given.
    """

    call: LayerCall
    norms: NormNames
    scales: ScaleNames = (None, None)
    accepts: Callable[[nn.Module], bool] = lambda layer: True
    """Whether a layer has the form (timm's and open_clip's forms check their classes)."""


def _block_call(
    rewrite: FusedAddNorm, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    block = rewrite.module
    attention = block.attn(rewrite.first_norm(hidden_states), *args, **kwargs)
    residual, normed = rewrite.add_norm(hidden_states, attention)
    return rewrite.add_scaled(residual, block.mlp(normed))


def _scaled_layer_call(rewrite: FusedAddNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    layer = rewrite.module
    attention, _ = layer.attention(rewrite.first_norm(hidden_states))
    residual, normed = rewrite.add_norm(hidden_states, attention)
    return rewrite.add_scaled(residual, layer.dropout(layer.mlp(normed)))


def _encoder_layer_call(
    rewrite: FusedAddNorm,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    layer = rewrite.module
    attention, _ = layer.self_attn(
        hidden_states=rewrite.first_norm(hidden_states), attention_mask=attention_mask, **kwargs
    )
    residual, normed = rewrite.add_norm(hidden_states, attention)
    return rewrite.add_scaled(residual, layer.mlp(normed))


ENCODER_LAYER = LayerForm(_encoder_layer_call, ("layer_norm1", "layer_norm2"))
"""transformers' CLIP-style encoder layer: ``self_attn`` (returning the output and weights)
between ``layer_norm1`` and ``layer_norm2``, no layer scales (CLIP, SigLIP, SigLIP2)."""
SCALED_LAYER = LayerForm(
    _scaled_layer_call, ("layernorm_before", "layernorm_after"), ("lambda_1", "lambda_2")
)
"""InternViT's layer: ``attention`` between ``layernorm_before`` and ``layernorm_after``, layer
scales ``lambda_1`` and ``lambda_2``."""
BLOCK = LayerForm(_block_call, ("norm1", "norm2"))
"""A block computing ``x + attn(norm1(x), ...)`` then ``x + mlp(norm2(x))`` (the Qwen and GLM
towers')."""


_MOVED_FORMS = {
    "TIMM_BLOCK": ("layergraph_adapters.timm_vit", "TIMM_BLOCK"),
    "OPEN_CLIP_BLOCK": ("layergraph_adapters.open_clip", "OPEN_CLIP_BLOCK"),
}
"""The frameworks' forms that lived here, by where their families' records are now."""


def _moved_form(name: str) -> LayerForm:
    module, attribute = _MOVED_FORMS[name]
    return getattr(importlib.import_module(module), attribute)


def _framework_form(layer: nn.Module) -> LayerForm | None:
    """The deprecated lookup of a form by the layer's class (timm's or open_clip's block)."""
    form = next((form for form in map(_moved_form, _MOVED_FORMS) if form.accepts(layer)), None)
    if form is not None:
        warn(
            "fuse_norm without the layers' form is deprecated since layergraph 0.2.1: pass "
            "their family's (layergraph_adapters.timm_vit.TIMM_BLOCK, "
            "layergraph_adapters.open_clip.OPEN_CLIP_BLOCK); the lookup by class goes in 0.3",
            LayergraphDeprecationWarning,
        )
    return form


def __getattr__(name: str) -> object:
    """``TIMM_BLOCK``, ``OPEN_CLIP_BLOCK`` and ``FRAMEWORK_FORMS``, which moved to the
    families' adapters, with a ``LayergraphDeprecationWarning`` (they go in 0.3)."""
    if name in _MOVED_FORMS or name == "FRAMEWORK_FORMS":
        warn(
            f"layergraph_adapters.kit.fused_norm.{name} moved to the family's adapter "
            "(layergraph_adapters.timm_vit.TIMM_BLOCK, layergraph_adapters.open_clip."
            "OPEN_CLIP_BLOCK) in layergraph 0.2.1; the name here goes in 0.3",
            LayergraphDeprecationWarning,
        )
        if name == "FRAMEWORK_FORMS":
            return tuple(map(_moved_form, _MOVED_FORMS))
        return _moved_form(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
