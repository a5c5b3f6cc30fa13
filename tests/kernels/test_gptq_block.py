"""Native `gptq_block` (kernels/native/gptq_ops.cpp): its bits do not depend on the thread count. With many rows
parallel_for runs the row loop inside an OpenMP region, with few (or one thread) inline in its caller; both must
round the product and the difference apart (issue 59: one path fused them into one FMA, and torchrun's one-thread
ranks wrote other GPTQ codes than one process on two threads)."""

from __future__ import annotations

import pytest
import torch


def _block_inputs(rows: int, block: int, asymmetric: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * block, block, generator=g) * torch.logspace(-2, 1, block)
    h = 2 * x.t() @ x / x.shape[0]
    h.diagonal().add_(0.01 * h.diagonal().mean())
    factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h.double())), upper=True).float()
    w = torch.randn(rows, block, generator=g)
    scales = w.abs().amax(dim=1, keepdim=True).expand(rows, block).contiguous() / 7
    zeros = torch.full((rows, block), 8.0) if asymmetric else None
    return w, factor, scales, zeros


def _run(ops, threads: int, w, factor, scales, zeros) -> tuple[torch.Tensor, ...]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = w.clone()
        codes, errors = torch.empty_like(w), torch.empty_like(w)
        ops.gptq_block(w, factor, scales, zeros, codes, errors, -8.0 if zeros is None else 0.0,
                       7.0 if zeros is None else 15.0)
        return w, codes, errors
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_one_thread_and_two_give_the_same_bits(ops, asymmetric: bool) -> None:
    inputs = _block_inputs(rows=1024, block=64, asymmetric=asymmetric)  # 32 rows a task: split over threads
    one, two = _run(ops, 1, *inputs), _run(ops, 2, *inputs)
    for name, a, b in zip(("updated weights", "codes", "errors"), one, two, strict=True):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


def test_rows_split_over_threads_give_the_bits_of_rows_run_alone(ops) -> None:
    """Each row's result is the same whether its task held many rows (a parallel region) or it ran by itself."""
    w, factor, scales, zeros = _block_inputs(rows=1024, block=64, asymmetric=False)
    _, codes, errors = _run(ops, 2, w, factor, scales, zeros)
    for row in (0, 517, 1023):
        _, row_codes, row_errors = _run(ops, 2, w[row:row + 1], factor, scales[row:row + 1], None)
        assert torch.equal(row_codes[0], codes[row]) and torch.equal(row_errors[0], errors[row]), row
