"""Fixtures of the kernel tests."""

from __future__ import annotations

import shutil

import pytest

from llmeasyquant.kernels import native


@pytest.fixture(scope="module")
def ops():
    """The fused C++ operators (kernels/native.py); the test is skipped where no compiler can build them."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the fused operators cannot be built")
    built = native.ops()
    assert built is not None, "a compiler is present, so the fused operators must build (see the log for why not)"
    return built
