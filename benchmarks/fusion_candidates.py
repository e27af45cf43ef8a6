"""Three rewrites timed alone at the benchmark towers' shapes, inside CUDA graphs, on the GPU.

- Patch embedding: the convolution (kernel = stride) against one matrix product of the
  gathered patches with the convolution's weight viewed as a matrix
  (``layergraph_adapters.kit.patch_embedding.patch_product``), each followed by the row-major
  token sequence the towers make of it.
- MLP up-projection and GELU: ``linear`` then ``gelu`` against ``torch._addmm_activation``
  (cuBLASLt's bias-and-GELU epilogue, the tanh approximation), also inside torch.compile.
- Residual adds and norm (``fuse_norm``): a layer's ``residual + scale * h`` and the norm
  after it as eager runs them (a multiply, an add, ``layer_norm`` or InternViT's RMSNorm)
  against ``layergraph.kernels.add_norm.add_norm``; and the layer's last
  ``residual + scale * h`` as a multiply and an add against one ``addcmul``. The error is the
  fused normed output's against a float32 computation of the same inputs.

Each time is :func:`layergraph.timing.captured_ms` (10 calls in one graph, median of 5
replays). Prints one line per measurement and writes them as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from layergraph.kernels.add_norm import add_norm, add_scaled
from layergraph.timing import captured_ms
from layergraph.validation import relative_error
from layergraph_adapters.kit.patch_embedding import patch_product

TOWERS = {  # name: (image size, patch, width, MLP width, tokens per image)
    "vit_base": (224, 16, 768, 3072, 197),
    "siglip-so400m": (384, 14, 1152, 4304, 729),
    "internvit-300m": (448, 14, 1024, 4096, 1025),
}
NORMS = {  # name: (width, tokens per image, norm)
    "vit_base": (768, 197, "layer_norm"),
    "siglip-so400m": (1152, 729, "layer_norm"),
    "internvit-300m": (1024, 1025, "layer_norm"),
    "internvit-6b": (3200, 1025, "rms_norm"),
}


def time_patch_embedding(
    pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> dict[str, Any]:
    """The convolution against the product, each ending in a row-major token sequence."""
    patch = weight.shape[-1]

    def convolution() -> torch.Tensor:
        out = F.conv2d(pixels, weight, bias, stride=patch)
        return out.flatten(2).transpose(1, 2).contiguous()

    def product() -> torch.Tensor:
        return patch_product(pixels, weight, bias).flatten(2).transpose(1, 2).contiguous()

    device = pixels.device
    return {
        "convolution_ms": captured_ms(convolution, device=device),
        "product_ms": captured_ms(product, device=device),
        "error": relative_error(product(), convolution()),
    }


def time_up_projection(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> dict[str, Any]:
    """``gelu(linear(...))`` against the GELU epilogue, eager and compiled."""

    def unfused() -> torch.Tensor:
        return F.gelu(F.linear(rows, weight, bias))

    def epilogue(bias: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)

    compiled = torch.compile(epilogue, dynamic=False)
    device = rows.device
    fused = epilogue(bias, rows, weight)
    return {
        "unfused_ms": captured_ms(unfused, device=device),
        "epilogue_ms": captured_ms(lambda: epilogue(bias, rows, weight), device=device),
        "compiled_epilogue_ms": captured_ms(lambda: compiled(bias, rows, weight), device=device),
        "product_alone_ms": captured_ms(lambda: F.linear(rows, weight, bias), device=device),
        "error_against_exact_gelu": relative_error(fused, unfused()),
        "error_against_tanh_gelu": relative_error(
            fused, F.gelu(F.linear(rows, weight, bias), approximate="tanh")
        ),
    }


def time_add_norm(
    residual: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, kind: str
) -> dict[str, Any]:
    """A layer's scaled residual add and norm, eager against the fused kernel; and its last
    scaled residual add, a multiply and an add against ``addcmul``."""
    width = residual.shape[-1]
    bias = torch.zeros_like(weight) if kind == "layer_norm" else None

    def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The norm as the towers compute it, in ``x``'s dtype with these weights."""
        if kind == "layer_norm":
            return F.layer_norm(x, (width,), weight, bias, 1e-6)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * normed.to(x.dtype)

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        summed = scale * h + residual
        return summed, norm(summed, weight, bias)

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return add_norm(residual, h, scale, weight, bias, 1e-6, kind)

    stored = (residual.float() + scale.float() * h.float()).to(residual.dtype).float()
    exact = norm(stored, weight.float(), None if bias is None else bias.float())
    device = residual.device
    return {
        "eager_add_norm_ms": captured_ms(eager, device=device),
        "fused_add_norm_ms": captured_ms(fused, device=device),
        "eager_scaled_add_ms": captured_ms(lambda: scale * h + residual, device=device),
        "addcmul_ms": captured_ms(lambda: add_scaled(residual, h, scale), device=device),
        "error": relative_error(fused()[1], exact),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for tower, (size, patch, width, mlp_width, tokens) in TOWERS.items():
        for batch in (1, 32):
            pixels = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
            weight = torch.randn(width, 3, patch, patch, device=device, dtype=dtype) * 0.02
            bias = torch.randn(width, device=device, dtype=dtype)
            rows.append(
                {"tower": tower, "batch": batch, "what": "patch embedding"}
                | time_patch_embedding(pixels, weight, bias)
            )
            print(rows[-1])
            hidden = torch.randn(batch * tokens, width, device=device, dtype=dtype)
            up = torch.randn(mlp_width, width, device=device, dtype=dtype) * width**-0.5
            up_bias = torch.randn(mlp_width, device=device, dtype=dtype) * 0.1
            rows.append(
                {"tower": tower, "batch": batch, "what": "up-projection and GELU"}
                | time_up_projection(hidden, up, up_bias)
            )
            print(rows[-1])
    for tower, (width, tokens, kind) in NORMS.items():
        for batch in (1, 13, 32):
            residual = torch.randn(batch * tokens, width, device=device, dtype=dtype)
            h = torch.randn(batch * tokens, width, device=device, dtype=dtype)
            scale = torch.rand(width, device=device, dtype=dtype)
            weight = torch.randn(width, device=device, dtype=dtype)
            rows.append(
                {"tower": tower, "batch": batch, "what": f"residual adds and {kind}"}
                | time_add_norm(residual, h, scale, weight, kind)
            )
            print(rows[-1])
    if args.json:
        record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        with open(args.json, "w") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()
