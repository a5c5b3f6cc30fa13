"""GPTQ (Frantar et al. 2022): quantize columns one by one, pushing each column's error onto the columns not yet
quantized through the inverse Hessian of the layer's inputs, H = 2/n · Σ x xᵀ.

Lazy batch updates (blocks of `block_size` columns), dampening (`damp` × mean diagonal), act-order (columns by
decreasing Hessian diagonal, on by default) with static groups: group scales are fixed from the original weights
before the solve, so an act-ordered layer still stores plain contiguous groups. Without act-order the columns of
the few channels with very large activations are quantized last, after every other column's error was pushed
onto them; on SmolLM2 that makes symmetric 4-bit GPTQ worse than round-to-nearest (docs/methods.md).

True sequential (`true_sequential`, off by default): the layers of a block are solved in groups that read the same
input (q/k/v, o, gate/up, down), and each group after the first against the Hessian of a new pass over the block in
which the groups before it are already quantized, so that a layer compensates the error of those feeding it (as
GPTQ's reference code and AutoGPTQ's `true_sequential` do). One pass of the block per later group.

On a non-uniform grid (scheme.grid) each column goes to its nearest grid level; the group scales (and a learned
grid's per-row tables) are always static, chosen from the original weights for the least squared error weighted by
the Hessian diagonal (each input's mean square), as the uniform scales are fixed before the solve under act-order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.kernels.native import ops
from llmeasyquant.methods.base import BlockContext, Quantizer, block_input_stats, rtn_quant_linear, short_of_tokens
from llmeasyquant.methods.stats import InputStats, collect_input_stats
from llmeasyquant.models.arch import linear_weight, set_module
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import carry_input_transform
from llmeasyquant.primitives import QParams, check_finite, choose_qparams, dequantize, group_width, qrange, quantize
from llmeasyquant.scheme import PerChannel, QuantScheme


@dataclass(frozen=True)
class GPTQ(Quantizer):
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True  # as llm-compressor's default: on this model it decides whether GPTQ beats RTN
    # A layer that read fewer calibration tokens (an expert the router sent few or none) has too poor a Hessian to
    # solve against: it is rounded to nearest instead, and the fallback named in the log and the checkpoint.
    min_tokens: int = 16
    true_sequential: bool = False  # each input group solved on a pass with the groups before it quantized

    name: ClassVar[str] = "gptq"
    needs_calibration: ClassVar[bool] = True
    default_scheme: ClassVar[str] = "w4a16-g128"  # what --method gptq quantizes to when no scheme is given
    input_stats: ClassVar[frozenset[str]] = frozenset({"hessian"})
    float_path: ClassVar[bool] = False

    @property
    def solves_apart(self) -> bool:
        return not self.true_sequential  # each group's statistics come from a pass after the groups before it

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        stats = block_input_stats(block, ctx, self.input_stats)
        if not self.true_sequential:
            self._solve(block, ctx, stats, list(ctx.plan))
            return
        groups = input_groups(stats, list(ctx.plan))
        for name in (n for group in groups[1:] for n in group):
            stats.hessian.pop(name, None)  # the float pass's: these layers are solved on a later pass's statistics
        for position, group in enumerate(groups):
            if position:  # what this group reads now that the groups before it are quantized
                stats, _ = collect_input_stats(block, group, ctx.inputs, ctx.kwargs, want=self.input_stats,
                                               routed=ctx.arch.routed)
            self._solve(block, ctx, stats, group)

    def _solve(self, block: nn.Module, ctx: BlockContext, stats: InputStats, names: list[str],
               target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Quantize the layers `names` of the block against the Hessians in `stats`: each layer's weight, or what
        `target` makes of it (GPTAQ's moved target)."""
        hessians = stats.hessian
        factors: dict[int, HessianFactor] = {}  # id of a Hessian -> its factor, while a layer still reads it
        for position, rel_name in enumerate(names):
            scheme = ctx.plan[rel_name]
            module = block.get_submodule(rel_name)
            if short_of_tokens(ctx, stats, [rel_name], self.min_tokens, self.name, "rounded to nearest (RTN)"):
                set_module(block, rel_name, rtn_quant_linear(module, scheme, ctx.prefix + rel_name))
                continue
            weight = linear_weight(module).detach().float()
            check_finite(weight, ctx.prefix + rel_name)
            if target is not None:
                weight = target(weight)
            # q, k and v (gate and up) share one Hessian and so one factor, made once. The last layer to read a
            # Hessian takes it out of the statistics, and the factor is made in its memory when one layer reads it
            # alone: an 8B down projection's H is 0.8 GB.
            hessian = hessians[rel_name]
            last = not any(hessians.get(other) is hessian for other in names[position + 1:])
            if last:
                hessians.pop(rel_name)
            if id(hessian) not in factors:
                factors[id(hessian)] = hessian_factor(hessian, self.damp, self.act_order, consume=last)
            factor = factors.pop(id(hessian)) if last else factors[id(hessian)]
            codes, qp = gptq_solve(weight, hessian, scheme, self.block_size, factor=factor)
            del hessian, factor
            bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
            layer = QuantLinear.from_codes(codes, qp, scheme, bias)
            set_module(block, rel_name, carry_input_transform(module, layer))


def input_groups(stats: InputStats, names: list[str]) -> list[list[str]]:
    """`names` in order, cut into runs of layers that read the same input (q/k/v, gate/up): those whose statistic
    (the Hessian, or the range where no Hessian was gathered) is one object."""
    shared = stats.hessian if stats.hessian else stats.lo
    groups: list[list[str]] = []
    for name in names:
        if groups and shared.get(name) is shared.get(groups[-1][0]):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


FACTOR_THREADS = 2  # LAPACK's threads for H⁻¹'s factor: fixed, so the bits do not depend on the process's count


@contextmanager
def fixed_threads() -> Iterator[None]:
    """Run on FACTOR_THREADS threads, whatever the process runs (inverse_factor_ says why), then restore."""
    before = torch.get_num_threads()
    if before != FACTOR_THREADS:
        torch.set_num_threads(FACTOR_THREADS)
    try:
        yield
    finally:
        if before != FACTOR_THREADS:
            torch.set_num_threads(before)


def inverse_factor_(h: torch.Tensor) -> torch.Tensor:
    """Overwrites H [in, in] (fp32) with the upper Cholesky factor of H⁻¹ and returns it: the same bits in every
    process.

    Factored in fp64, then rounded to fp32, on FACTOR_THREADS threads whatever the process runs: LAPACK's fp64 result
    depends on the thread count in its last bits, a last bit can cross an fp32 rounding boundary (1 entry in 10⁶ at
    1536 columns, 1 against 4 or 16 threads; 21 of 2·10⁸ at 14336, 1 against 2), and GPTQ's error feedback carries
    it into other codes, so one process and the ranks torchrun starts (one thread each) would differ. Two threads,
    not one: an 8B model's 14336-column factor takes 48 s instead of 90 on the 2-core Xeon of docs/RESULTS.md (the
    largest step of a block); on more cores the rest stay idle meanwhile (docs/distributed.md). The three steps run
    in place on one fp64 copy (1.6 GB at 14336 columns), stored column-major: LAPACK's layout, which spares each
    step a copy of its own."""
    with fixed_threads():
        h64 = torch.empty_strided(h.shape, (1, h.shape[0]), dtype=torch.float64, device=h.device).copy_(h)
        torch.linalg.cholesky(h64, out=h64)
        torch.cholesky_inverse(h64, out=h64)
        torch.linalg.cholesky(h64, upper=True, out=h64)
        return h.copy_(h64)


def _group_params(weight: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None = None) -> QParams:
    return choose_qparams(weight, scheme.bits, scheme.symmetric, scheme.granularity, grid=scheme.grid,
                          importance=importance)


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ solves against, from H alone: shared by the layers that read one input (q, k and v)."""
    upper: torch.Tensor  # [in, in] fp32: the upper Cholesky factor of (P H Pᵀ + damping)⁻¹
    perm: torch.Tensor  # [in] the column order (act-order: by decreasing H diagonal; else the identity)
    dead: torch.Tensor  # [in] bool: inputs that were always zero
    diagonal: torch.Tensor  # [in] H's diagonal (dead inputs at 1), undamped: a grid's importance
    act_order: bool


@torch.no_grad()
def hessian_factor(hessian: torch.Tensor, damp: float = 0.01, act_order: bool = False,
                   consume: bool = False) -> HessianFactor:
    """H [in, in] (fp32) made ready to solve against; with `consume` in H's memory (left holding the factor)
    instead of a copy."""
    h = hessian if consume and hessian.dtype == torch.float32 else hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that were always zero: any value works, pick zero
    h[dead, dead] = 1
    diagonal = torch.diag(h).clone()
    perm = torch.argsort(diagonal, descending=True) if act_order else torch.arange(h.shape[0])
    if act_order:  # rows, then columns, one copy at a time
        h.copy_(h.index_select(0, perm))
        h.copy_(h.index_select(1, perm))
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))
    return HessianFactor(upper=inverse_factor_(h), perm=perm, dead=dead, diagonal=diagonal, act_order=act_order)


@torch.no_grad()
def gptq_solve(weight: torch.Tensor, hessian: torch.Tensor | None, scheme: QuantScheme, block_size: int = 128,
               damp: float = 0.01, act_order: bool = False, consume: bool = False,
               factor: HessianFactor | None = None) -> tuple[torch.Tensor, QParams]:
    """Codes [out, in] (int8, signed domain) and their qparams for `weight` [out, in] given H [in, in] (fp32), or
    given its `factor` (made by `hessian_factor` with the damping and act-order wanted; then `hessian`, `damp`,
    `act_order` and `consume` are not read). With `consume` the solve works in H's memory instead of a copy."""
    if factor is None:
        factor = hessian_factor(hessian, damp, act_order, consume)
    rows, cols = weight.shape
    w = weight.clone()
    w[:, factor.dead] = 0
    width = group_width(scheme.granularity, cols)
    per_column_group = torch.arange(cols) // width  # [in]
    # Static groups: scales from the original weight. Without act-order the same choice is made group by group
    # from the updated weights as the solve reaches each group (the paper's procedure), below.
    # A grid's scales and tables are static always (a learned table belongs to the whole row), weighted by H's diagonal.
    if scheme.grid is not None:
        static = _group_params(w, scheme, importance=factor.diagonal.clamp(min=0))
    else:
        static = _group_params(w, scheme) if factor.act_order or isinstance(scheme.granularity, PerChannel) else None
    perm, hinv = factor.perm, factor.upper
    if factor.act_order:
        w = w[:, perm]
    codes = torch.zeros(rows, cols)
    scales = torch.zeros(rows, -(-cols // width))
    zeros = None if scheme.symmetric else torch.zeros_like(scales, dtype=torch.int32)
    if static is not None:
        scales.copy_(static.scale.expand_as(scales))
        if zeros is not None:
            zeros.copy_(static.zero.expand_as(zeros))
    # Static uniform parameters: the column loop runs natively (the same bits, kernels/native/gptq_ops.cpp).
    native = ops() if static is not None and static.levels is None and w.device.type == "cpu" else None
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        w1, hinv1 = w[:, start:end].clone(), hinv[start:end, start:end]
        if native is not None:
            err1, block_codes = torch.empty_like(w1), torch.empty_like(w1)
            columns = per_column_group[perm[start:end]]  # each column's group
            native.gptq_block(w1, hinv1, scales.index_select(1, columns),
                              None if zeros is None else zeros.index_select(1, columns).float(), block_codes, err1,
                              *qrange(scheme.bits))
            codes[:, start:end] = block_codes
        else:
            err1 = _solve_columns(w, w1, hinv1, codes, scales, zeros, static, scheme, perm, per_column_group, width,
                                  start)
        w[:, end:] -= err1 @ hinv[start:end, end:]
    codes = codes[:, torch.argsort(perm)]
    qp = QParams(scale=scales, zero=zeros, group_size=width, levels=static.levels if static is not None else None)
    return codes.to(torch.int8), qp


def _solve_columns(w: torch.Tensor, w1: torch.Tensor, hinv1: torch.Tensor, codes: torch.Tensor,
                   scales: torch.Tensor, zeros: torch.Tensor | None, static: QParams | None, scheme: QuantScheme,
                   perm: torch.Tensor, per_column_group: torch.Tensor, width: int, start: int) -> torch.Tensor:
    """The columns of the lazy block w1 = w[:, start:end] one by one (w1 updated in place, codes and, for dynamic
    groups, scales and zeros written); returns the block's errors [rows, end - start] for the update after it."""
    cols, end = w.shape[1], start + w1.shape[1]
    err1 = torch.zeros_like(w1)
    for i in range(end - start):
        col = int(perm[start + i])
        group = int(per_column_group[col])
        if static is None and col % width == 0:
            # Dynamic groups (no act-order, so columns arrive in order): fix this group's scale now.
            g_end = min(col + width, cols)
            block_part = torch.cat((w1[:, i:], w[:, end:]), dim=1)[:, : g_end - col]
            qp = _group_params(block_part, scheme)
            scales[:, group] = qp.scale[:, 0]
            if zeros is not None:
                zeros[:, group] = qp.zero[:, 0]
        scale = scales[:, group]
        zero = zeros[:, group] if zeros is not None else None
        column_qp = QParams(scale[:, None], None if zero is None else zero[:, None], group_size=1,
                            levels=static.levels if static is not None else None)
        q = quantize(w1[:, i : i + 1], column_qp, scheme.bits)  # [rows, 1]
        codes[:, start + i] = q[:, 0]
        dequant = dequantize(q, column_qp)[:, 0]
        err = (w1[:, i] - dequant) / hinv1[i, i]
        w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
        err1[:, i] = err
    return err1
