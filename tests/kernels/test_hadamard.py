"""The online Hadamard transform (kernels/hadamard.py): the butterfly, native and in PyTorch operators, against the
dense matrix product; orthogonality; the fallback used where the native operators are off."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmeasyquant.kernels import native
from llmeasyquant.kernels.hadamard import hadamard_matrix, hadamard_reference, hadamard_transform
from llmeasyquant.methods.rotate import rotation_factors, rotation_matrix

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
# 64 = 2^6, 576 = 64 * 9 (SmolLM2's hidden size), 1536 = 512 * 3 (its intermediate size), 7 (odd: no Hadamard part),
# 96 = 32 * 3
SIZES = [64, 576, 1536, 7, 96]


def factors(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    signs, odd = rotation_factors(width, seed=5)
    return signs.float(), odd.float()


def rows(count: int, width: int) -> torch.Tensor:
    x = torch.randn(count, width, generator=torch.Generator().manual_seed(width))
    x[:, 3 % width] *= 50.0  # an outlier channel, as the down-projection's input has
    return x


@pytest.mark.parametrize("width", SIZES)
def test_reference_equals_the_dense_product_and_rotate_matrix(width):
    signs, odd = factors(width)
    dense = hadamard_matrix(signs, odd)
    torch.testing.assert_close(dense @ dense.T, torch.eye(width, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(dense, rotation_matrix(width, seed=5), atol=1e-6, rtol=0)  # only fp32 rounding of O
    x = rows(5, width)
    expected = (x.double() @ dense).float()
    torch.testing.assert_close(hadamard_reference(x, signs, odd), expected, atol=1e-4, rtol=1e-5)
    # Orthogonal: the norm of each row is kept, and the outlier spread over the channels.
    torch.testing.assert_close(hadamard_reference(x, signs, odd).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the native operators cannot be built")
@pytest.mark.parametrize("count", [1, 3, 300])  # 300 rows: a prompt, split over the threads
@pytest.mark.parametrize("width", SIZES)
def test_native_operator_equals_the_reference(width, count):
    ops = native.ops()
    assert ops is not None, "a compiler is present, so the native operators must build (see the log for why not)"
    signs, odd = factors(width)
    x = rows(count, width)
    torch.testing.assert_close(ops.hadamard_transform(x, signs, odd), hadamard_reference(x, signs, odd),
                               atol=1e-5, rtol=1e-5)


def test_fallback_is_used_when_native_is_off_and_computes_the_same(monkeypatch):
    signs, odd = factors(1536)
    x = rows(4, 1536).reshape(2, 2, 1536)  # a batch of sequences: any leading shape
    on = hadamard_transform(x, signs, odd)
    monkeypatch.setenv("LLMEASYQUANT_NATIVE", "0")
    assert native.ops() is None
    off = hadamard_transform(x, signs, odd)
    assert off.shape == x.shape
    torch.testing.assert_close(off, on, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(off, hadamard_reference(x, signs, odd), atol=0, rtol=0)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the native operators cannot be built")
def test_native_operator_refuses_bad_shapes():
    ops = native.ops()
    with pytest.raises(RuntimeError, match="power of two"):
        ops.hadamard_transform(torch.zeros(1, 12), torch.ones(12), torch.eye(5))  # 12 = 5 * ?
    with pytest.raises(RuntimeError, match="power of two"):
        ops.hadamard_transform(torch.zeros(1, 24), torch.ones(24), torch.eye(1))  # 24 is no power of two
