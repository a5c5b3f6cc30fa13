"""Input statistics of a block's linear layers from one forward pass over its calibration inputs.

Linears that read the same tensor (q, k and v; gate and up) share one accumulation: the statistic is computed once
and handed to each of them.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def collect_hessians(block: nn.Module, names: list[str], inputs: list[torch.Tensor],
                     kwargs: list[dict]) -> dict[str, torch.Tensor]:
    """{linear name: H = 2/n · Σ x xᵀ [in, in]} over every token of every calibration batch."""
    sums: dict[str, torch.Tensor] = {}
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
            sums[name] = sums.get(name, 0) + flat.t() @ flat
            counts[name] = counts.get(name, 0) + flat.shape[0]

        return hook

    handles = [block.get_submodule(name).register_forward_hook(hook_for(name)) for name in names]
    try:
        for x, kw in zip(inputs, kwargs, strict=True):
            seen_this_pass.clear()
            block(x, **kw)
    finally:
        for handle in handles:
            handle.remove()
    hessians = {name: 2 * sums[name] / counts[name] for name in sums}
    for name, owner in alias.items():
        hessians[name] = hessians[owner]
    missing = [n for n in names if n not in hessians]
    if missing:
        raise RuntimeError(f"no calibration input reached {missing}; the block's forward never called them")
    return hessians
