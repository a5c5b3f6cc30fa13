"""GPTAQ (GPTQv2; Li et al., ICML 2025, "asymmetric calibration"): GPTQ fitted to the unquantized model's outputs.

GPTQ minimises ||X̃ (Ŵ - W)ᵀ||² over a layer's codes Ŵ, X̃ being what the layer reads in the model quantized so
far (tokens × inputs): the layer learns to reproduce its float weights' response to inputs that already carry the
rounding of every earlier layer, and that rounding stays. GPTAQ fits the unquantized model's outputs instead,
||X̃ Ŵᵀ - X Wᵀ||², X being what the layer reads in the unquantized model. With ΔX = X - X̃ that objective is
GPTQ's with the target moved:

    ||X̃ Ŵᵀ - X Wᵀ||² = ||X̃ (Ŵ - W*)ᵀ||² + const,   W* = W + W ΔXᵀ X̃ (X̃ᵀX̃)⁻¹

(W* the least-squares float weight on the quantized inputs), so GPTQ's column solve runs unchanged on W* against
X̃'s Hessian. The inverse takes GPTQ's dampening, and only the correction goes through it: where the two models
read the same inputs W* is W exactly (W* = W Xᵀ X̃ (X̃ᵀX̃ + λI)⁻¹ instead shrinks every weight along the inputs'
weak directions; a first version solving that, on X̃ read before any group was quantized, wrecked SmolLM2). The
paper folds the same correction into GPTQ's column loop; solving for W* first reaches the same objective in closed form.

The runner carries the unquantized model's activations beside the quantized ones (`float_path`). A block's layers
go in groups that read one input (q/k/v, o, gate/up, down), in order, as GPTQ's `true_sequential` does: each group's
X̃ is read on a pass with the groups before it quantized, its X on the block's unquantized copy, and both products
X̃ᵀX̃ and X̃ᵀΔX are exact sums (methods/gram.py), so the codes do not depend on the order of the batches.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import distributed
from llmeasyquant.methods.base import BlockContext, block_input_stats
from llmeasyquant.methods.gptq import GPTQ, fixed_threads, input_groups
from llmeasyquant.methods.gram import ExactGram
from llmeasyquant.models.arch import linear_weight
from llmeasyquant.nn.transform import transformed_input


@dataclass(frozen=True)
class GPTAQ(GPTQ):
    true_sequential: bool = True  # always: each group's X̃ must carry the rounding of the groups before it

    name: ClassVar[str] = "gptaq"
    float_path: ClassVar[bool] = True  # the unquantized model's activations, beside the quantized ones
    # The runner's pass gives only which layers share an input (and their token counts): the products are formed
    # here, group by group, so the float pass's Hessians (1.5 GB a block at 8B) are never gathered.
    input_stats: ClassVar[frozenset[str]] = frozenset({"range"})

    def __post_init__(self) -> None:
        if not self.true_sequential:
            raise ConfigError("gptaq always solves a block's input groups in order, each on a pass with the groups "
                              "before it quantized: drop --no-true-sequential")

    def apply(self, block: nn.Module, ctx: BlockContext) -> None:
        if ctx.arch.routed:
            raise ConfigError(f"gptaq pairs what each layer reads in the quantized and in the unquantized model token "
                              f"by token, and {ctx.arch.family}'s router may send a token to other experts in each: "
                              "use gptq")
        if ctx.float_inputs is None:
            raise ConfigError("gptaq needs the unquantized model's activations: run it through quantize()")
        stats = block_input_stats(block, ctx, self.input_stats)
        groups = input_groups(stats, list(ctx.plan))
        stats.hessian.clear()  # an earlier method's (AWQ's) if any: this method forms its own products
        float_block = copy.deepcopy(block)  # the unquantized block, read for X while `block` is quantized
        for group in groups:
            hessian, shift, tokens = paired_products(block, float_block, group[0], ctx)
            group_stats = dataclasses.replace(stats, hessian=dict.fromkeys(group, 2 * hessian / tokens))
            self._solve(block, ctx, group_stats, group,
                        target=lambda weight, h=hessian, s=shift: float_output_target(weight, h, s, self.damp))


@torch.no_grad()
def paired_products(block: nn.Module, float_block: nn.Module, name: str, ctx: BlockContext
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(Σ X̃ᵀX̃, Σ X̃ᵀ(X - X̃) [in, in] fp32, tokens) for linear `name`: X̃ its inputs in `block` on the quantized
    model's activations, X in `float_block` on the unquantized model's, batch by batch; over every rank's batches
    under torch.distributed (exact sums, so the same bits as one process)."""
    seen: dict[str, torch.Tensor] = {}

    def grab(tag: str):
        def hook(module: nn.Module, args: tuple, _output: object) -> None:
            seen[tag] = transformed_input(module, args[0]).reshape(-1, args[0].shape[-1]).float()
        return hook

    handles = [block.get_submodule(name).register_forward_hook(grab("quantized")),
               float_block.get_submodule(name).register_forward_hook(grab("float"))]
    width = linear_weight(block.get_submodule(name)).shape[1]
    own, shift, tokens = ExactGram(width), ExactGram(width, paired=True), 0
    try:
        for x, x_float, kwargs in zip(ctx.inputs, ctx.float_inputs, ctx.kwargs, strict=True):
            block(x, **kwargs)
            float_block(x_float, **kwargs)
            own.add(seen["quantized"])
            shift.add(seen["quantized"], seen["float"] - seen["quantized"])
            tokens += seen["quantized"].shape[0]
            seen.clear()
    finally:
        for handle in handles:
            handle.remove()
    return own.reduce(1), shift.reduce(1), int(distributed.all_reduce(torch.tensor(tokens, dtype=torch.int64)))


def float_output_target(weight: torch.Tensor, hessian: torch.Tensor, shift: torch.Tensor, damp: float
                        ) -> torch.Tensor:
    """W* = W + W ΔXᵀ X̃ (X̃ᵀX̃ + λI)⁻¹ [out, in] fp32 from Σ X̃ᵀX̃ and Σ X̃ᵀΔX, λ = damp × the mean diagonal (GPTQ's),
    solved in fp64 on FACTOR_THREADS threads so that the bits do not depend on the process's thread count."""
    with fixed_threads():
        h = hessian.double()
        h.diagonal().add_(damp * h.diagonal().mean())
        w = weight.double()
        # (X̃ᵀX̃ + λI)⁻¹ X̃ᵀΔX Wᵀ = the correction's transpose
        correction = torch.cholesky_solve(shift.double() @ w.t(), torch.linalg.cholesky(h)).t()
        return (w + correction).float().contiguous()
