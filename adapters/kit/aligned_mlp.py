"""An MLP whose hidden width is padded with zeros to a multiple of 64 for its matrix products.

A hidden width that is not a multiple of 8 (Qwen2.5-VL's vision MLP: 3420) leaves every row of
the MLP's weights and activations misaligned for 16-byte loads, and cuBLAS then falls back to
tensor-core kernels several times slower than its Hopper ones (on an H200, the three products of
Qwen2.5-VL-7B's tower MLPs ran at about a third of the rate of the aligned ones). Padding the
hidden width with zero rows and columns changes no value: the padded units get zero weight and
bias on the way in and zero weight on the way out.

:class:`AlignedMLP` is a change made through the wrapper's ledger, like
:class:`~layergraph_adapters.kit.fused_qkv.FusedQKV`. Applied, it copies the MLP's weights into
padded tensors and makes the module's own parameters views of them (the same ``Parameter``
objects, ``state_dict`` keys unchanged, in-place updates reaching the padded tensors; the
down projection's weight becomes a view with a row stride of the padded width). For a gated
MLP (``gate_proj``, ``up_proj``, ``down_proj``) the gate and up weights are one padded tensor,
so the two products are one. :meth:`AlignedMLP.forward` computes the MLP from the padded
tensors; the module's own forward still works on the views. Undone, each parameter gets its
own storage back, holding the values it holds then; re-allocated parameters are padded again by
:meth:`AlignedMLP.refresh`.

With ``fuse_activation`` (the ``fuse_gate`` option), a gated MLP whose activation is SiLU also
computes ``silu(gate) * up`` from the one product's two halves with one Triton kernel
(:func:`layergraph.kernels.gated.silu_and_mul`) where a call fits it
(:func:`~layergraph_adapters.kit.triton_kernels.kernel_takes`), and takes a hidden width
that is already aligned (joining gate and up without padding).

What this does not do: pad an MLP whose hidden width is already a multiple of 8 (there is
nothing to gain), or combine with tensor-parallel (DTensor) weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layergraph.ledger import Change
from layergraph_adapters.kit.rewrites import InferenceForward, give_back_storage
from layergraph_adapters.kit.triton_kernels import kernel_takes, triton_unavailable

__all__ = ["MLP_LAYOUTS", "AlignedForward", "AlignedMLP", "mlp_layout"]

MULTIPLE = 64
"""The padded hidden width is a multiple of this."""


@dataclass(frozen=True)
class MLPLayout:
    """Where an MLP module keeps its projections and activation."""

    up: tuple[str, ...]
    """The input projections: ``(gate, up)`` for a gated MLP, one name for a plain one."""
    down: str
    activation: str

    @property
    def gated(self) -> bool:
        return len(self.up) == 2


MLP_LAYOUTS = (
    MLPLayout(("gate_proj", "up_proj"), "down_proj", "act_fn"),
    MLPLayout(("fc1",), "fc2", "act"),
    MLPLayout(("linear_fc1",), "linear_fc2", "act_fn"),
)
"""The MLP layouts recognised: transformers' gated MLPs (Qwen2.5-VL, GLM) and plain ones
(Qwen2-VL's ``VisionMlp``, Qwen3-VL's)."""


def mlp_layout(module: nn.Module) -> MLPLayout | None:
    """The layout of ``module`` among :data:`MLP_LAYOUTS`, or ``None``."""
    for layout in MLP_LAYOUTS:
        names = (*layout.up, layout.down)
        if all(isinstance(getattr(module, name, None), nn.Linear) for name in names) and callable(
            getattr(module, layout.activation, None)
        ):
            return layout
    return None


def _round_up(value: int) -> int:
    return -(-value // MULTIPLE) * MULTIPLE


class AlignedMLP(Change):
    """The padded weights of one MLP module; see the module docstring.

    :attr:`up_weight` (``[len(up) * padded, width]``), :attr:`up_bias` and
    :attr:`down_weight` (``[width, padded]``) exist from the first :meth:`apply` on and are
    kept across an undo, so that applying again reuses them and the graphs' addresses hold.
    """

    up_weight: torch.Tensor
    up_bias: torch.Tensor | None
    down_weight: torch.Tensor

    def __init__(self, module: nn.Module, *, fuse_activation: bool = False) -> None:
        layout = mlp_layout(module)
        if layout is None:
            raise ValueError(
                f"align_mlp needs an MLP with {' or '.join(_describe(lay) for lay in MLP_LAYOUTS)}"
                f"; {type(module).__name__} has none of them"
            )
        self.layout = layout
        self.target = module
        projections = self._up()
        hidden = projections[0].out_features
        self.activation: Callable[[torch.Tensor], torch.Tensor] = getattr(module, layout.activation)
        if fuse_activation:
            _check_fusable(module, layout, self.activation, projections[0].weight.device)
        self.fuse_activation = fuse_activation
        """Whether ``silu(gate) * up`` runs as one kernel (``fuse_gate``)."""
        if hidden % 8 == 0 and not fuse_activation:
            raise ValueError(
                f"align_mlp: {type(module).__name__}'s hidden width {hidden} is already a "
                f"multiple of 8, so its products are aligned"
            )
        if any(hasattr(p.weight, "to_local") for p in (*projections, self._down())):
            raise ValueError("align_mlp does not combine with tensor-parallel (DTensor) weights")
        self.hidden = hidden
        self.padded = _round_up(hidden) if hidden % 8 else hidden
        parts = [f"MLP hidden width {hidden} padded to {self.padded} with zeros"]
        if self.padded == hidden:
            parts = [f"MLP of hidden width {hidden}"]
        if layout.gated:
            parts.append("gate and up in one product")
        if fuse_activation:
            parts.append("SiLU and product in one kernel")
        options = ["align_mlp"] if self.padded != hidden else []
        options += ["fuse_gate"] if fuse_activation else []
        self.options = ", ".join(options)
        """The options this change serves, as its descriptions name them."""
        self.what = f"{', '.join(parts)} ({self.options})"
        self._own: list[torch.Tensor] = []
        """The parameters' own data from before :meth:`apply`."""

    def _up(self) -> list[nn.Linear]:
        return [getattr(self.target, name) for name in self.layout.up]

    def _down(self) -> nn.Linear:
        return getattr(self.target, self.layout.down)

    def _parameters(self) -> list[nn.Parameter]:
        up = self._up()
        return (
            [p.weight for p in up]
            + [p.bias for p in up if p.bias is not None]
            + [self._down().weight]
        )

    def apply(self) -> None:
        self._own = [p.data for p in self._parameters()]
        self._pad()

    @torch.no_grad()
    @torch.inference_mode(False)  # shared tensors stay normal ones, written in any mode
    def _pad(self) -> None:
        up, down = self._up(), self._down()
        weight = up[0].weight
        rows = len(up) * self.padded
        if not _fits(getattr(self, "up_weight", None), (rows, weight.shape[1]), weight):
            self.up_weight = weight.new_zeros(rows, weight.shape[1])
            self.down_weight = weight.new_zeros(down.weight.shape[0], self.padded)
            self.up_bias = None
        if up[0].bias is not None and not _fits(self.up_bias, (rows,), up[0].bias):
            self.up_bias = up[0].bias.new_zeros(rows)
        for index, projection in enumerate(up):
            part = slice(index * self.padded, index * self.padded + self.hidden)
            self.up_weight[part].copy_(projection.weight.data)
            projection.weight.data = self.up_weight[part]
            if projection.bias is not None:
                self.up_bias[part].copy_(projection.bias.data)
                projection.bias.data = self.up_bias[part]
        self.down_weight[:, : self.hidden].copy_(down.weight.data)
        down.weight.data = self.down_weight[:, : self.hidden]

    def undo(self) -> None:
        give_back_storage(self._parameters(), self._own)
        self._own = []

    @torch.compiler.disable
    def refresh(self) -> None:
        """Pad again if a projection's weight no longer lives in the padded tensors (the model
        was moved or its parameters assigned). Never traced by ``torch.compile``."""
        row = self.up_weight.stride(0) * self.up_weight.element_size()
        expected = [
            self.up_weight.data_ptr() + index * self.padded * row
            for index in range(len(self.layout.up))
        ] + [self.down_weight.data_ptr()]
        actual = [p.weight.data_ptr() for p in self._up()] + [self._down().weight.data_ptr()]
        if actual != expected:
            self._pad()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP of ``hidden_states`` from the padded tensors: the module's own computation,
        up to the products' rounding."""
        inner = F.linear(hidden_states, self.up_weight, self.up_bias)
        if self.layout.gated:
            gate, up = inner.split(self.padded, dim=-1)
            if self.fuse_activation and kernel_takes(gate):
                from layergraph.kernels.gated import silu_and_mul

                rows = (-1, self.padded)
                inner = silu_and_mul(gate.reshape(rows), up.reshape(rows)).view(gate.shape)
            else:
                inner = self.activation(gate) * up
        else:
            inner = self.activation(inner)
        return F.linear(inner, self.down_weight, self._down().bias)


def _check_fusable(
    module: nn.Module,
    layout: MLPLayout,
    activation: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> None:
    """Raise ``ValueError`` unless ``fuse_gate`` can serve ``module``: a gated MLP whose
    activation computes SiLU (checked on points in [-8, 8]), on a device Triton runs on."""
    name = type(module).__name__
    if not layout.gated:
        raise ValueError(
            f"fuse_gate needs a gated MLP (gate_proj, up_proj, down_proj); {name} is not"
        )
    probe = torch.linspace(-8, 8, 65)
    try:
        with torch.no_grad():
            silu = torch.allclose(activation(probe), F.silu(probe), rtol=0, atol=1e-6)
    except Exception:  # whatever the failure, an activation that fails the probe is no SiLU
        silu = False
    if not silu:
        raise ValueError(
            f"fuse_gate fuses SiLU only; {name}'s activation is {type(activation).__name__}"
        )
    reason = triton_unavailable("fuse_gate", device)
    if reason is not None:
        raise ValueError(reason)


def _fits(tensor: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> bool:
    return (
        tensor is not None
        and tuple(tensor.shape) == shape
        and tensor.dtype == like.dtype
        and tensor.device == like.device
    )


def _describe(layout: MLPLayout) -> str:
    return "/".join((*layout.up, layout.down))


class AlignedForward(InferenceForward):
    """The MLP's inference calls computed from its padded weights (:meth:`AlignedMLP.forward`);
    applied after its :class:`AlignedMLP`."""

    def __init__(self, alignment: AlignedMLP) -> None:
        super().__init__(
            alignment.target, f"MLP computed from its joined weights ({alignment.options})"
        )
        self.alignment = alignment

    def compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.alignment.forward(hidden_states)
