"""Input statistics of a block's linear layers from one forward pass over its calibration inputs.

Linears that read the same tensor (q, k and v; gate and up) share one accumulation: the statistic is computed once
and handed to each of them. The sequential runner collects them during the pass that computes the float block's
outputs, so the first method of a recipe gets them without a pass of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from llmeasyquant.infra import distributed
from llmeasyquant.infra.exact_sum import ExactSum, exact_totals
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import transformed_input

STATS = frozenset({"hessian", "range"})


@dataclass
class InputStats:
    hessian: dict[str, torch.Tensor]  # H = 2/n · Σ x xᵀ [in, in] fp32 over every calibration token (an exact sum)
    lo: dict[str, torch.Tensor]  # min x per input channel [in]
    hi: dict[str, torch.Tensor]  # max x per input channel [in]
    kinds: frozenset[str] = STATS  # which of the two were collected

    @property
    def absmax(self) -> dict[str, torch.Tensor]:
        """max |x| per input channel [in]."""
        return {name: torch.maximum(-self.lo[name], self.hi[name]) for name in self.lo}

    def divided(self, names: list[str], scales: torch.Tensor) -> InputStats:
        """The statistics once the inputs of `names` are divided channel-wise by `scales` [in] (as SmoothQuant
        and AWQ do), computed from these ones instead of by another pass over the data."""
        hessian, lo, hi = dict(self.hessian), dict(self.lo), dict(self.hi)
        for name in names:
            if name in hessian:
                hessian[name] = self.hessian[name] / scales[:, None] / scales[None, :]
            if name in lo:
                lo[name], hi[name] = self.lo[name] / scales, self.hi[name] / scales
        return InputStats(hessian=hessian, lo=lo, hi=hi, kinds=self.kinds)


def first_output(output: object) -> torch.Tensor:
    """A block's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple | list) else output


@torch.no_grad()
def run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """The block's hidden-state outputs for each calibration batch."""
    return [first_output(block(x, **kw)) for x, kw in zip(inputs, kwargs, strict=True)]


def relative_error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """||outputs - reference|| / ||reference|| over all batches (of every rank, under torch.distributed).

    Each batch's two sums go row by row (a reduction along the last axis, the same at any thread count) into
    math.fsum, and the batches into exact sums: the same bits whichever rank held which batch, so a search that
    compares such errors (SmoothQuant's alpha) chooses the same on one process and on several ranks."""
    terms = [(_square_sum(q.double() - r.double()), _square_sum(r.double()))
             for q, r in zip(outputs, reference, strict=True)]
    num, den = exact_totals(terms, 2)
    return (num / den) ** 0.5 if den > 0 else 0.0


def _square_sum(x: torch.Tensor) -> float:
    return math.fsum(x.pow(2).sum(-1).flatten().tolist())


@torch.no_grad()
def collect_input_stats(block: nn.Module, names: list[str], inputs: list[torch.Tensor], kwargs: list[dict],
                        keep_outputs: bool = False, want: frozenset[str] = STATS
                        ) -> tuple[InputStats, list[torch.Tensor] | None]:
    """Statistics of what each named linear reads, and (optionally) the block's outputs, from one pass.

    `want` picks the statistics ("hessian", "range"): a Hessian costs a GEMM per input, so only those who use it
    pay for it; the others come back empty."""
    sums: dict[str, ExactSum] = {}
    lo: dict[str, torch.Tensor] = {}
    hi: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    alias: dict[str, str] = {}  # name -> the name whose accumulation it shares
    # Inputs seen in the current forward pass, held (not just their addresses, which a freed tensor's successor
    # could reuse) so that "the same tensor" means the same object.
    seen_this_pass: list[tuple[torch.Tensor, str]] = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, _output: object) -> None:
            x = args[0]
            owner = next((n for t, n in seen_this_pass if t is x), None)
            if owner is not None:
                alias[name] = owner
                return
            seen_this_pass.append((x, name))
            flat = transformed_input(module, x).reshape(-1, x.shape[-1]).float()  # [tokens, in], as W reads it
            if "hessian" in want:
                # Each batch's product alone (in fp32, the same on whichever rank holds the batch), summed exactly:
                # the order of the batches, and how they are split over ranks, changes no bit of H.
                if name not in sums:
                    sums[name] = ExactSum((flat.shape[1], flat.shape[1]))
                sums[name].add(flat.t() @ flat)
            if "range" in want:
                low, high = flat.amin(dim=0), flat.amax(dim=0)
                lo[name] = torch.minimum(lo[name], low) if name in lo else low
                hi[name] = torch.maximum(hi[name], high) if name in hi else high
            counts[name] = counts.get(name, 0) + flat.shape[0]

        return hook

    outputs: list[torch.Tensor] | None = [] if keep_outputs else None
    handles = [block.get_submodule(name).register_forward_hook(hook_for(name)) for name in names]
    try:
        for x, kw in zip(inputs, kwargs, strict=True):
            seen_this_pass.clear()
            out = first_output(block(x, **kw))
            if outputs is not None:
                outputs.append(out)
    finally:
        for handle in handles:
            handle.remove()
    missing = [n for n in names if n not in counts and n not in alias]
    if missing:
        raise RuntimeError(f"no calibration input reached {missing}; the block's forward never called them")
    # Under torch.distributed each rank saw its share of the batches: sum the statistics over ranks (in the order
    # the hooks fired, which every rank shares) so that all of them hold the statistics of all the data. Counts
    # are integers, minima and maxima exact, and the Gram sums exact: the result is the single process's, bit for bit.
    for name in counts:
        counts[name] = int(distributed.all_reduce(torch.tensor(counts[name], dtype=torch.int64)))
        if name in sums:
            sums[name].all_reduce()
        if name in lo:
            lo[name], hi[name] = distributed.all_reduce(lo[name], "min"), distributed.all_reduce(hi[name], "max")
    hessian = {name: (2 * sums[name].value() / counts[name]).float() for name in sums}
    for name, owner in alias.items():
        if owner in hessian:
            hessian[name] = hessian[owner]
        if owner in lo:
            lo[name], hi[name] = lo[owner], hi[owner]
    return InputStats(hessian=hessian, lo=lo, hi=hi, kinds=frozenset(want)), outputs


def static_input_layers(block: nn.Module) -> dict[str, QuantLinear]:
    """The block's quantized linears whose activations take a static (calibrated) scale."""
    return {name: m for name, m in block.named_modules() if isinstance(m, QuantLinear) and m.static_input}


@torch.no_grad()
def calibrate_static_inputs(block: nn.Module, stats: InputStats | None, inputs: list[torch.Tensor],
                            kwargs: list[dict]) -> None:
    """Set the static activation scale of each such layer from the range of its calibration inputs.

    The ranges come from `stats` when they hold them (the float block's inputs, kept exact through smoothing),
    otherwise from one pass over the quantized block with those layers scaling their inputs on the fly."""
    layers = static_input_layers(block)
    if not layers:
        return
    if stats is None or "range" not in stats.kinds or not set(layers) <= set(stats.lo):
        for layer in layers.values():
            layer.observing = True
        try:
            stats, _ = collect_input_stats(block, list(layers), inputs, kwargs, want=frozenset({"range"}))
        finally:
            for layer in layers.values():
                layer.observing = False
    for name, layer in layers.items():
        layer.set_input_range(float(stats.lo[name].min()), float(stats.hi[name].max()))
