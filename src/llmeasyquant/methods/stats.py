"""Input statistics of a block's linear layers from one forward pass over its calibration inputs.

Linears that read the same tensor (q, k and v; gate and up) share one accumulation: the statistic is computed once
and handed to each of them. The sequential runner collects them during the pass that computes the float block's
outputs, so the first method of a recipe gets them without a pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

STATS = frozenset({"hessian", "absmax"})


@dataclass
class InputStats:
    hessian: dict[str, torch.Tensor]  # H = 2/n · Σ x xᵀ [in, in] over every calibration token
    absmax: dict[str, torch.Tensor]  # max |x| per input channel [in]
    kinds: frozenset[str] = STATS  # which of the two were collected


def first_output(output: object) -> torch.Tensor:
    """A block's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple | list) else output


@torch.no_grad()
def collect_input_stats(block: nn.Module, names: list[str], inputs: list[torch.Tensor], kwargs: list[dict],
                        keep_outputs: bool = False, want: frozenset[str] = STATS
                        ) -> tuple[InputStats, list[torch.Tensor] | None]:
    """Statistics of what each named linear reads, and (optionally) the block's outputs, from one pass.

    `want` picks the statistics ("hessian", "absmax"): a Hessian costs a GEMM per input, so only those who use it
    pay for it; the others come back empty."""
    sums: dict[str, torch.Tensor] = {}
    absmax: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    alias: dict[str, str] = {}  # name -> the name whose accumulation it shares
    # Inputs seen in the current forward pass, held (not just their addresses, which a freed tensor's successor
    # could reuse) so that "the same tensor" means the same object.
    seen_this_pass: list[tuple[torch.Tensor, str]] = []

    def hook_for(name: str):
        def hook(_module: nn.Module, args: tuple, _output: object) -> None:
            x = args[0]
            owner = next((n for t, n in seen_this_pass if t is x), None)
            if owner is not None:
                alias[name] = owner
                return
            seen_this_pass.append((x, name))
            flat = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
            if "hessian" in want:
                sums[name] = sums.get(name, 0) + flat.t() @ flat
            if "absmax" in want:
                peak = flat.abs().amax(dim=0)
                absmax[name] = torch.maximum(absmax[name], peak) if name in absmax else peak
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
    hessian = {name: 2 * sums[name] / counts[name] for name in sums}
    for name, owner in alias.items():
        if owner in hessian:
            hessian[name] = hessian[owner]
        if owner in absmax:
            absmax[name] = absmax[owner]
    return InputStats(hessian=hessian, absmax=absmax, kinds=frozenset(want)), outputs
