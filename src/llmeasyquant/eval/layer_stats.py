"""Per-layer measurements of a quantized model against its unquantized source, for the comparison figures:
output errors block by block, a weight histogram, per-layer distribution summaries, perplexity over context length.

Errors are measured on block outputs, not on single linear layers: SmoothQuant and AWQ rescale a linear layer's
output channels and undo it in the next layer, so only a block's output is comparable with the unquantized model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmeasyquant.eval.perplexity import evaluate_windows
from llmeasyquant.models.arch import arch_for, get_module, linear_weight
from llmeasyquant.nn.qlinear import quantized_layers


@torch.no_grad()
def _outputs(model: nn.Module, names: list[str], window: torch.Tensor) -> dict[str, torch.Tensor]:
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str, out: object) -> None:
        captured[name] = (out[0] if isinstance(out, tuple) else out).detach().float()

    hooks = [get_module(model, name).register_forward_hook(lambda _m, _i, out, name=name: keep(name, out))
             for name in names]
    try:
        model(window.unsqueeze(0), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def block_output_errors(reference: nn.Module, model: nn.Module, window: torch.Tensor) -> dict[str, float]:
    """‖H_q − H‖ / ‖H‖ of every block's output hidden states on one window, each model fed the window as a whole
    (so a block's error includes what the blocks before it passed on). Keys are the blocks' module paths."""
    blocks = arch_for(model).blocks
    names = [f"{blocks}.{i}" for i in range(len(get_module(model, blocks)))]
    ours, theirs = _outputs(model, names, window), _outputs(reference, names, window)
    return {name: float((ours[name] - theirs[name]).norm() / theirs[name].norm().clamp_min(1e-12)) for name in names}


def representative_layer(model: nn.Module) -> str:
    """The middle quantized layer in model order: one layer whose histogram stands for the model."""
    names = list(quantized_layers(model))
    return names[len(names) // 2]


def weight_histogram(reference: nn.Module, model: nn.Module, name: str, bins: int = 80) -> dict:
    """Histogram of one layer's weights before (the reference's) and after quantization, on shared bin edges."""
    before = linear_weight(get_module(reference, name)).detach().float().flatten()
    after = get_module(model, name).dequantize().flatten()
    lo, hi = float(min(before.min(), after.min())), float(max(before.max(), after.max()))
    edges = torch.linspace(lo, hi, bins + 1)
    return {"layer": name, "edges": edges.tolist(),
            "float": torch.histc(before, bins, lo, hi).int().tolist(),
            "quantized": torch.histc(after, bins, lo, hi).int().tolist()}


SUMMARY_FEATURES = ("log_std", "kurtosis", "absmax_over_std", "code_entropy_bits", "zero_code_share",
                    "log_output_error")


def weight_summaries(model: nn.Module, block_errors: dict[str, float]) -> dict[str, list[float]]:
    """Per quantized layer, the features named in SUMMARY_FEATURES: the shape of its dequantized weights, how its
    codes are used, and the output error (log) of the block holding it."""
    summaries = {}
    for name, layer in quantized_layers(model).items():
        block = next((b for b in block_errors if name.startswith(b + ".")), None)
        weight = layer.dequantize().flatten()
        std = float(weight.std()) or 1e-12
        centred = (weight - weight.mean()) / std
        codes = layer.codes().flatten().to(torch.int64)
        counts = torch.bincount(codes - codes.min()).float()
        probs = counts[counts > 0] / counts.sum()
        summaries[name] = [math.log(std), float((centred**4).mean()), float(weight.abs().max()) / std,
                           float(-(probs * probs.log2()).sum()), float((codes == 0).float().mean()),
                           math.log(max(block_errors.get(block, 1e-12), 1e-12))]
    return summaries


def context_perplexities(model: nn.Module, ids: torch.Tensor, lengths: tuple[int, ...],
                         windows: int) -> dict[str, float]:
    """Perplexity at each context length: the first `windows` non-overlapping windows of that length of `ids`
    (1-D token ids), the same text for every length. Lengths the text cannot fill once are skipped."""
    from llmeasyquant.eval.perplexity import EvalWindows

    result = {}
    for length in lengths:
        count = min(windows, ids.numel() // length)
        if count == 0:
            continue
        chunk = ids[: count * length].reshape(count, length)
        metrics = evaluate_windows({"m": model}, EvalWindows(chunk, {}), progress=False)["m"]
        result[str(length)] = metrics["ppl"]
    return result
