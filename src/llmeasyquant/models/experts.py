"""Mixture-of-experts blocks as one set of linears per expert.

transformers 5 stores a block's experts fused: one module with `gate_up_proj` [experts, 2·intermediate, hidden] and
`down_proj` [experts, hidden, intermediate], looping over the experts that tokens were routed to. The methods of
this toolkit quantize linear modules, one Hessian or activation range each, so `unfuse_experts` replaces that module
with `RoutedExperts`: a ModuleList holding one `ExpertMLP` (gate_proj, up_proj, down_proj as nn.Linear) per expert,
called with the same (hidden states, top-k indices, top-k weights) and computing the same sum. Each expert's
linears then see only the tokens routed to it, which is what the calibration hooks count. The router (and
Qwen2-MoE's shared-expert gate) is left where it is.

The architecture table (models/arch.py, `ExpertsSpec`) says where the fused module is and what its parameters are
called; nothing here names a family.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmeasyquant.models.arch import ExpertsSpec, arch_for, get_module

log = logging.getLogger(__name__)


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), as the fused module computes it for the expert's rows."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.ModuleList):
    """The experts of one block, called as transformers' fused experts module is: each token's output is the sum of
    its top-k experts' outputs weighted by the router's weights. Only the experts some token was routed to run."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [tokens, hidden]
        for expert in torch.unique(top_k_index).tolist():  # ascending, as the fused loop visits them
            if expert >= len(self):
                continue  # transformers' index for "no local expert" (expert parallelism): skipped there too
            token_idx, slot = torch.where(top_k_index == expert)
            # The fused loop orders an expert's rows by top-k slot, then token: the same rows reach each linear.
            order = torch.argsort(slot * top_k_index.shape[0] + token_idx)
            token_idx, slot = token_idx[order], slot[order]
            y = self[expert](hidden_states[token_idx]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _split(fused: nn.Module, spec: ExpertsSpec) -> RoutedExperts:
    gate_up, down = getattr(fused, spec.gate_up).detach(), getattr(fused, spec.down).detach()
    count, double_inter, hidden = gate_up.shape
    inter = double_inter // 2
    experts = []
    for e in range(count):
        gate = nn.Linear(hidden, inter, bias=False, dtype=gate_up.dtype, device=gate_up.device)
        up = nn.Linear(hidden, inter, bias=False, dtype=gate_up.dtype, device=gate_up.device)
        proj = nn.Linear(inter, hidden, bias=False, dtype=down.dtype, device=down.device)
        gate.weight.data.copy_(gate_up[e, :inter])  # the fused module's chunk(2): gate rows first
        up.weight.data.copy_(gate_up[e, inter:])
        proj.weight.data.copy_(down[e])
        experts.append(ExpertMLP(gate, up, proj, getattr(fused, spec.activation)))
    return RoutedExperts(experts)


@torch.no_grad()
def unfuse_experts(model: nn.Module) -> nn.Module:
    """Replace each block's fused experts module by a `RoutedExperts` with the same weights, in place; returns the
    model. Does nothing for a dense family, for blocks the config keeps dense, or for experts already split."""
    arch = arch_for(model)
    spec = arch.experts
    if spec is None:
        return model
    split = 0
    for block in get_module(model, arch.blocks):
        parent_path, _, leaf = spec.path.rpartition(".")
        try:
            parent = get_module(block, parent_path)
        except AttributeError:
            continue
        fused = getattr(parent, leaf, None)
        if fused is None or isinstance(fused, RoutedExperts) or getattr(fused, spec.gate_up, None) is None:
            continue  # a dense block (Qwen MoE's mlp_only_layers), or split already
        setattr(parent, leaf, _split(fused, spec))
        split += 1
    if split:
        log.debug("split the fused experts of %d blocks into per-expert linears", split)
    return model


def expert_tokens(tokens: dict[str, int], spec: ExpertsSpec, experts: int) -> list[int]:
    """How many calibration tokens each expert of one block saw, from its layers' token counts (block-relative
    names): what its gate projection read."""
    return [tokens.get(f"{spec.path}.{e}.gate_proj", 0) for e in range(experts)]
