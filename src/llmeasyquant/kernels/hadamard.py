"""The online Hadamard transform of a layer's input rows: x -> x diag(s) (H ⊗ O) / sqrt(2^a) for a width of
2^a * m, H the Walsh-Hadamard matrix of order 2^a and O an orthogonal matrix of order m (methods/rotate.py builds
the factors; nn/transform.py holds them in a layer).

H is never formed: the row, read as X [2^a, m], is multiplied by O on the right (m^2 products per group), then
H runs down the groups in log2(2^a) butterfly stages, so a 1536-wide row (512 x 3) costs some 15k additions
instead of a 1536 x 1536 product. The fused C++ operator (native/decoder_ops.cpp) does it in one call;
`hadamard_reference` does the same stages in PyTorch operators where the native operators are off
(LLMEASYQUANT_NATIVE=0) or cannot be built, and is what the operator is tested against.
"""

from __future__ import annotations

import torch

from llmeasyquant.kernels import native


def walsh_hadamard(order: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of a power-of-two order, entries ±1 (float64)."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"a Walsh-Hadamard matrix has a power-of-two order, not {order}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < order:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_matrix(signs: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """The transform as a dense matrix [width, width] (fp64): diag(signs) (H ⊗ odd) / sqrt(width / m)."""
    power = signs.numel() // odd.shape[0]
    return signs.double()[:, None] * torch.kron(walsh_hadamard(power) / power**0.5, odd.double())


def hadamard_reference(x: torch.Tensor, signs: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """x [..., width] fp32 -> x diag(signs) (H ⊗ odd) / sqrt(width / m), in PyTorch operators."""
    shape, width, m = x.shape, x.shape[-1], odd.shape[0]
    power = width // m
    y = x.reshape(-1, width) * signs
    if m > 1:
        y = (y.reshape(-1, power, m) @ odd).reshape(-1, width)
    h = 1
    while h < power:  # one butterfly stage: pairs of spans of h * m values, h apart in groups
        pairs = y.reshape(-1, power // (2 * h), 2, h * m)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) * (1.0 / power**0.5)).to(x.dtype)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """`hadamard_reference`'s result for x [..., width] (computed in fp32, returned in x's dtype), by the native
    operator where it is on and x is on the CPU."""
    ops = native.ops() if x.device.type == "cpu" else None
    if ops is None:
        return hadamard_reference(x.float(), signs.float(), odd.float()).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).float()
    return ops.hadamard_transform(rows, signs.float(), odd.float()).reshape(x.shape).to(x.dtype)
