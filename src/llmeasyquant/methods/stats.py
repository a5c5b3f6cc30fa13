"""Per-input-channel activation statistics of a block's linears, from one pass over the calibration inputs."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def collect_input_stats(block: nn.Module, names: list[str], inputs: list[torch.Tensor],
                        kwargs: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """{linear name: {"absmax": [in], "absmean": [in], "tokens": scalar}} of the inputs each linear reads."""
    stats: dict[str, dict[str, torch.Tensor]] = {}

    def hook_for(name: str):
        def hook(_module: nn.Module, args: tuple, _output: object) -> None:
            flat = args[0].reshape(-1, args[0].shape[-1]).float().abs()  # [tokens, in]
            entry = stats.setdefault(name, {"absmax": torch.zeros(flat.shape[1]), "abssum": torch.zeros(flat.shape[1]),
                                            "tokens": torch.zeros(())})
            entry["absmax"] = torch.maximum(entry["absmax"], flat.amax(dim=0))
            entry["abssum"] += flat.sum(dim=0)
            entry["tokens"] += flat.shape[0]

        return hook

    handles = [block.get_submodule(name).register_forward_hook(hook_for(name)) for name in names]
    try:
        for x, kw in zip(inputs, kwargs, strict=True):
            block(x, **kw)
    finally:
        for handle in handles:
            handle.remove()
    missing = [n for n in names if n not in stats]
    if missing:
        raise RuntimeError(f"no calibration input reached {missing}; the block's forward never called them")
    return {n: {"absmax": s["absmax"], "absmean": s["abssum"] / s["tokens"], "tokens": s["tokens"]}
            for n, s in stats.items()}


def collect_input_absmax(block: nn.Module, names: list[str], inputs: list[torch.Tensor],
                         kwargs: list[dict]) -> dict[str, torch.Tensor]:
    return {n: s["absmax"] for n, s in collect_input_stats(block, names, inputs, kwargs).items()}
