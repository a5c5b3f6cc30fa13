"""Per-layer sensitivity: what quantizing one linear layer alone, at each candidate scheme, costs the model.

- `kl`: measured. The layer's candidate weights (GPTQ or RTN) replace its float weights while every other layer
  stays float; the KL divergence of the model's next-token distribution from the float model's, per token, on a few
  calibration samples. Only the blocks from the layer's own onward are re-run: earlier hidden states are cached.
  The widest candidate's KL (near zero) is the next one's scaled by the ratio of their output errors.
- `output`: the layer's relative output error ‖ΔW X‖² / ‖W X‖² on the calibration inputs, from its input Hessian.
- `hessian`: HAWQ-v2's estimate ½ · tr(∇²_W L) / n · ‖ΔW‖², the trace of the loss Hessian of each layer's weights
  by Hutchinson's estimator (Rademacher probes, Hessian-vector products by double backward).
- `entropy`: data-free. High-resolution quantization theory: a b-bit code of data whose entropy at a fine grid is
  H bits leaves a squared error of about 2^(2(H-b))/12 fine steps; H is the entropy of the layer's 8-bit codes.
  Layers whose weights carry more information lose more at a given width.

Each returns {layer name: [loss per candidate scheme]}; lower is better, and losses add across layers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from llmeasyquant.calibration.sequential import capture_block_inputs
from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.gptq import gptq_solve
from llmeasyquant.methods.stats import collect_input_stats, run_block
from llmeasyquant.models.arch import arch_for, blocks_of, get_module, linear_weight, set_module
from llmeasyquant.primitives import check_finite, choose_qparams, dequantize, quantize
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)

SENSITIVITIES = ("kl", "output", "hessian", "entropy")
QUANTIZERS = ("gptq", "rtn")


def candidate_weight(weight: torch.Tensor, hessian: torch.Tensor | None, scheme: QuantScheme,
                     quantizer: str) -> torch.Tensor:
    """The float weight [out, in] the layer would hold once quantized with `scheme` by `quantizer`."""
    if quantizer == "gptq":
        codes, qp = gptq_solve(weight, hessian, scheme, act_order=True)
    else:
        qp = choose_qparams(weight, scheme.bits, scheme.symmetric, scheme.granularity, grid=scheme.grid)
        codes = quantize(weight, qp, scheme.bits)
    return dequantize(codes, qp)


def code_entropy(weight: torch.Tensor, scheme: QuantScheme) -> float:
    """Shannon entropy (bits) of the weight's 8-bit codes on the scheme's granularity and symmetry."""
    qp = choose_qparams(weight, 8, scheme.symmetric, scheme.granularity)
    counts = torch.bincount((quantize(weight, qp, 8).flatten().long() + 128), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def entropy_sensitivity(weight: torch.Tensor, schemes: Sequence[QuantScheme]) -> list[float]:
    entropy = code_entropy(weight, schemes[0])
    return [weight.numel() * 2.0 ** (2 * (entropy - s.bits)) / 12 for s in schemes]


class _Tail:
    """Runs the model from block `k` to the log-probabilities, on cached hidden states of the probe samples."""

    def __init__(self, model: nn.Module, kwargs: list[dict]) -> None:
        arch = arch_for(model)
        self.blocks = blocks_of(model)
        self.norm = get_module(model, arch.final_norm)
        self.head = get_module(model, arch.lm_head)
        self.kwargs = kwargs

    @torch.no_grad()
    def logprobs(self, start: int, hidden: list[torch.Tensor]) -> torch.Tensor:
        for block in self.blocks[start:]:
            hidden = run_block(block, hidden, self.kwargs)
        flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden])  # [tokens, hidden]
        return self.head(self.norm(flat)).float().log_softmax(dim=-1)


class _Reference:
    """The float model's next-token log-probabilities on the probe tokens, with their exponent computed once."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs  # [tokens, vocab]
        self.probs = logprobs.exp()

    def kl(self, logprobs: torch.Tensor) -> float:
        """Mean KL(P_ref || P) per token (the difference taken per element: small KLs keep their precision)."""
        return float((self.probs * (self.logprobs - logprobs)).sum(dim=-1).mean())


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias.float())
    return layer


def hessian_traces(model: nn.Module, ids: torch.Tensor, names: Sequence[str], probes: int = 8,
                   seed: int = 0) -> dict[str, float]:
    """tr(∇²_W L) of each named layer's weight, L the mean next-token loss on `ids` (Hutchinson, `probes` draws)."""
    params = [get_module(model, n).weight for n in names]  # the Parameter itself (Conv1D's is transposed)
    flags = {p: p.requires_grad for p in model.parameters()}
    previous = getattr(model.config, "_attn_implementation", None)
    traces = dict.fromkeys(names, 0.0)
    generator = torch.Generator().manual_seed(seed)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        model.set_attn_implementation("eager")  # fused attention kernels have no double backward on every device
        with torch.enable_grad():
            loss = model(ids, labels=ids, use_cache=False).loss
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for probe in range(probes):
                vectors = [torch.randint(0, 2, g.shape, generator=generator).float() * 2 - 1 for g in grads]
                products = torch.autograd.grad(grads, params, grad_outputs=vectors, retain_graph=probe < probes - 1)
                for name, v, hv in zip(names, vectors, products, strict=True):
                    traces[name] += float((v * hv).sum()) / probes
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        if previous is not None:
            model.set_attn_implementation(previous)
    return traces


def _kl_with(quantized: torch.Tensor, block: nn.Module, rel: str, module: nn.Module, bias: torch.Tensor | None,
             start: int, hidden: list[torch.Tensor], tail: _Tail, reference: _Reference) -> float:
    """The model's KL from the float model with layer `rel` of `block` (number `start`) holding `quantized`."""
    set_module(block, rel, _float_linear(quantized, bias))
    try:
        return max(reference.kl(tail.logprobs(start, hidden)), 0.0)
    finally:
        set_module(block, rel, module)


def _layer_losses(weight: torch.Tensor, h: torch.Tensor | None, schemes: Sequence[QuantScheme], kind: str,
                  quantizer: str, trace: float | None, kl_of: Callable[[torch.Tensor], float]) -> list[float]:
    """One layer's loss per candidate (see the module's docstring for each kind)."""
    row, proxy = [], []
    for position, scheme in enumerate(schemes):
        quantized = candidate_weight(weight, h, scheme, quantizer)
        delta = weight - quantized
        proxy.append(float(((delta @ h) * delta).sum() if h is not None else delta.pow(2).sum()))
        if kind == "output":
            row.append(proxy[-1] / float(((weight @ h) * weight).sum().clamp_min(1e-30)))
        elif kind == "hessian":
            row.append(0.5 * trace / weight.numel() * float(delta.pow(2).sum()))
        elif position == len(schemes) - 1 and position > 0:
            # The widest candidate's KL is near the noise floor and a full tail pass would cost a quarter of the
            # search: scale the next one's by the ratio of their output errors (KL is quadratic in small
            # perturbations, as the squared error is).
            row.append(row[-1] * proxy[-1] / proxy[-2] if proxy[-2] > 0 else 0.0)
        else:
            row.append(kl_of(quantized))
    return row


@torch.no_grad()
def layer_sensitivities(model: nn.Module, names: Sequence[str], schemes: Sequence[QuantScheme], kind: str,
                        quantizer: str, calib: torch.Tensor | None, probe: torch.Tensor | None,
                        progress: bool = True, hutchinson_probes: int = 8) -> dict[str, list[float]]:
    """Loss per candidate scheme (in increasing bit width) for every named linear inside the transformer blocks.

    `calib` [samples, seqlen] feeds the GPTQ Hessians and the `output` error; `probe` [samples, tokens] the KL and
    Hessian-trace estimates. The model is left as it was."""
    if kind not in SENSITIVITIES:
        raise ConfigError(f"unknown sensitivity {kind!r}; choose one of {', '.join(SENSITIVITIES)}")
    if quantizer not in QUANTIZERS:
        raise ConfigError(f"unknown search quantizer {quantizer!r}; choose one of {', '.join(QUANTIZERS)}")
    arch = arch_for(model)
    if kind == "entropy":
        return {n: entropy_sensitivity(linear_weight(get_module(model, n)).detach().float(), schemes) for n in names}
    need_hessian = quantizer == "gptq" or kind == "output"
    if (need_hessian and calib is None) or (kind in ("kl", "hessian") and probe is None):
        raise ConfigError(f"sensitivity {kind!r} with {quantizer} needs calibration samples; pass calibration text")
    prefix = arch.blocks + "."
    per_block: dict[int, list[str]] = {}
    for name in names:
        index, _, rel = name[len(prefix):].partition(".")
        per_block.setdefault(int(index), []).append(rel)
    inputs, kwargs = capture_block_inputs(model, calib) if need_hessian else (None, None)
    hidden = probe_kwargs = tail = reference = None
    if kind == "kl":
        hidden, probe_kwargs = capture_block_inputs(model, probe)
        tail = _Tail(model, probe_kwargs)
        reference = _Reference(tail.logprobs(0, hidden))
    traces: dict[str, float] = {}
    if kind == "hessian":
        traces = hessian_traces(model, probe, names, hutchinson_probes)
        log.debug("Hessian traces: %s", traces)
        # A negative estimate (an indefinite Hessian away from a minimum, or probe noise) is raised to a floor, so
        # the layer still ranks by its weight error instead of counting as free.
        floor = 0.01 * sum(abs(t) for t in traces.values()) / len(traces)
        traces = {name: max(trace, floor) for name, trace in traces.items()}
    losses: dict[str, list[float]] = {}
    blocks = blocks_of(model)
    for index in tqdm(range(len(blocks)), desc=f"sensitivity ({kind})", unit="block", disable=not progress):
        block, rels = blocks[index], per_block.get(index, [])
        hessians = {}
        if need_hessian:
            stats, outputs = collect_input_stats(block, rels, inputs, kwargs, keep_outputs=True,
                                                 want=frozenset({"hessian"}))
            hessians = stats.hessian
        for rel in rels:
            module = block.get_submodule(rel)
            weight = linear_weight(module).detach().float()
            check_finite(weight, prefix + f"{index}.{rel}")
            bias = module.bias.detach() if getattr(module, "bias", None) is not None else None

            kl_of = functools.partial(_kl_with, block=block, rel=rel, module=module, bias=bias, start=index,
                                      hidden=hidden, tail=tail, reference=reference)
            losses[prefix + f"{index}.{rel}"] = _layer_losses(
                weight, hessians.get(rel), schemes, kind, quantizer, traces.get(prefix + f"{index}.{rel}"), kl_of)
        if need_hessian:
            inputs = outputs
        if kind == "kl":
            hidden = run_block(block, hidden, probe_kwargs)
    return losses
