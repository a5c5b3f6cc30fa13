"""Per-layer mixed precision: measure each linear layer's sensitivity at every candidate bit width, then allocate
bits under a size budget (average bits per quantized weight, or bytes of stored tensors). The result is a Plan
with one rule per layer, applied with `quantize(model, recipe, plan)` or `llmeasyquant quantize --plan`.

Sizes are exact: a candidate's cost is the bytes its QuantLinear stores (codes, scales, zero points), the same
count `bits_per_weight` reports for the quantized model, so a plan within the budget gives a checkpoint within it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.export.checkpoint import stored_tensors
from llmeasyquant.infra.files import check_output, write_atomic
from llmeasyquant.methods import ModelTransform, recipe_by_name
from llmeasyquant.models.arch import arch_for, get_module, linear_weight
from llmeasyquant.nn.qlinear import layer_storage_bytes
from llmeasyquant.plan import Plan, Rule
from llmeasyquant.scheme import PerChannel, PerGroup, QuantScheme, parse_scheme
from llmeasyquant.search.allocate import SOLVERS
from llmeasyquant.search.sensitivity import QUANTIZERS, SENSITIVITIES, layer_sensitivities

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    """Exactly one of: average stored bits per quantized weight (scales and zeros included), or bytes of every
    tensor the checkpoint stores (quantized layers plus the float tensors in fp16)."""

    avg_bits: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.avg_bits is None) == (self.max_bytes is None):
            raise ConfigError("give exactly one budget: an average bit width (--avg-bits) or a size (--max-mb)")
        if self.avg_bits is not None and not (0 < self.avg_bits <= 32):
            raise ConfigError(f"--avg-bits must lie in (0, 32], got {self.avg_bits}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"--max-mb must be positive, got {self.max_bytes / 2**20:g} MB")

    def label(self) -> str:
        return f"{self.avg_bits:g} bits" if self.avg_bits is not None else f"{self.max_bytes / 2**20:.2f} MB"


@dataclass(frozen=True)
class MixedPrecisionSearch:
    candidates: tuple[int, ...] = (2, 3, 4, 8)
    group_size: int | None = 128  # None: per output channel
    symmetric: bool = False
    # The quantizer the plan is made for, and that makes each candidate's weights, optionally after whole-model
    # transforms ("rotate+gptq"): the sensitivities are then measured on the transformed model.
    method: str = "gptq"
    # Named weight-only schemes to choose from instead of `candidates` x `group_size` x `symmetric` (e.g.
    # w3a16-g64-asym, w4a16-g64-learned, w8a16-g64): each carries its own group, symmetry and grid.
    candidate_schemes: tuple[str, ...] = ()
    sensitivity: str = "kl"
    solver: str = "exact"
    lam: float = 0.0  # λ of Σ loss + λ·Σ bits: > 0 trades quality for size below the budget
    probe_samples: int = 2  # calibration samples for the KL / Hessian-trace estimates
    probe_tokens: int = 256  # their length

    def __post_init__(self) -> None:
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ConfigError(f"candidates must be distinct bit widths, got {self.candidates}")
        if len(set(self.candidate_schemes)) != len(self.candidate_schemes):
            raise ConfigError(f"candidate schemes must be distinct, got {', '.join(self.candidate_schemes)}")
        if self.sensitivity not in SENSITIVITIES:
            raise ConfigError(f"unknown sensitivity {self.sensitivity!r}; choose one of {', '.join(SENSITIVITIES)}")
        *transforms, quantizer = self.method.split("+")
        if quantizer not in QUANTIZERS or not all(isinstance(step, ModelTransform)
                                                  for step in recipe_by_name("+".join(transforms) or "rtn")[:-1]):
            raise ConfigError(f"the search quantizes with {' or '.join(QUANTIZERS)}, after whole-model transforms "
                              f"only (e.g. rotate+gptq), not {self.method!r}")
        if self.solver not in SOLVERS:
            raise ConfigError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")
        if self.lam < 0 or self.probe_samples <= 0 or self.probe_tokens <= 1:
            raise ConfigError("lam must be >= 0, probe_samples > 0 and probe_tokens > 1")
        self.schemes()  # unsupported bit widths and bad group sizes fail here

    def schemes(self) -> list[QuantScheme]:
        """The candidates, cheapest first (by the bits a 1024 x 1024 layer stores, then by name)."""
        if not self.candidate_schemes:
            granularity = PerChannel() if self.group_size is None else PerGroup(self.group_size)
            return [QuantScheme(bits, self.symmetric, granularity) for bits in sorted(self.candidates)]
        schemes = [parse_scheme(name) for name in self.candidate_schemes]
        for scheme in schemes:
            if scheme.act is not None:
                raise ConfigError(f"candidate {scheme.name} quantizes activations, which the search does not "
                                  "measure (it scores each layer's weights); give weight-only schemes (a16)")
        return sorted(schemes, key=lambda s: (layer_storage_bytes(1024, 1024, s), s.name))

    @property
    def quantizer(self) -> str:
        return self.method.split("+")[-1]

    def transformed(self, model: nn.Module) -> nn.Module:
        """`model` as the recipe's whole-model transforms leave it (a copy), or `model` itself without any."""
        transforms = [step for step in recipe_by_name(self.method) if isinstance(step, ModelTransform)]
        if not transforms:
            return model
        model = copy.deepcopy(model)
        for step in transforms:
            step.apply_model(model, arch_for(model))
        return model

    @property
    def needs_calibration(self) -> bool:
        return self.sensitivity != "entropy" or self.quantizer == "gptq"

    def run(self, model: nn.Module, calib: torch.Tensor | None, budget: Budget, progress: bool = True,
            keep_fp32: bool = False) -> SearchResult:
        """Search a plan for `model` (float) with calibration token ids `calib` [samples, seqlen]."""
        return self.allocate(self.measure(model, calib, progress, keep_fp32), budget)

    def measure(self, model: nn.Module, calib: torch.Tensor | None, progress: bool = True,
                keep_fp32: bool = False) -> Sensitivities:
        """The costly half: every layer's loss at every candidate (reusable for any number of budgets)."""
        start = time.perf_counter()
        arch = arch_for(model)
        if arch.experts is not None:
            # The fused experts hold no linears to measure, and split ones read routed shares of the tokens, which
            # the sensitivities do not follow: a plan made here would leave the experts out.
            raise ConfigError(f"mixed-precision search does not cover the mixture of experts of {arch.family} yet; "
                              "quantize it with one scheme (or a plan of your own)")
        if self.needs_calibration and calib is None:
            raise ConfigError(f"sensitivity {self.sensitivity!r} with {self.method} needs calibration data; pass "
                              "calibration text (--calib), or use --sensitivity entropy --method rtn")
        names = _searched_layers(model)
        probe = calib[: self.probe_samples, : self.probe_tokens] if calib is not None else None
        # A rotation changes what is stored beside the searched layers too (it unties a tied LM head).
        work = self.transformed(model)
        losses = layer_sensitivities(work, names, self.schemes(), self.sensitivity, self.quantizer, calib, probe,
                                     progress)
        shapes = {n: tuple(linear_weight(get_module(model, n)).shape) for n in names}  # [out, in]
        return Sensitivities(tuple(names), shapes, losses, _fixed_bytes(work, names, keep_fp32),
                             time.perf_counter() - start)

    def allocate(self, sens: Sensitivities, budget: Budget) -> SearchResult:
        """The cheap half: the best plan within `budget` for measured sensitivities."""
        start = time.perf_counter()
        schemes, names = self.schemes(), sens.layers
        costs = [[8 * layer_storage_bytes(sens.shapes[n][1], sens.shapes[n][0], s) for s in schemes] for n in names]
        weights = sum(o * i for o, i in sens.shapes.values())
        if budget.avg_bits is not None:
            budget_bits = math.floor(budget.avg_bits * weights)
        else:
            budget_bits = 8 * (budget.max_bytes - sens.fixed_bytes)
            if budget_bits <= 0:
                raise ConfigError(f"--max-mb {budget.label()} is below what the unquantized tensors alone take "
                                  f"({sens.fixed_bytes / 2**20:.2f} MB)")
        allocation = SOLVERS[self.solver](costs, [sens.losses[n] for n in names], budget_bits, self.lam)
        chosen = {n: schemes[j] for n, j in zip(names, allocation.choice, strict=True)}
        layers = [LayerChoice(n, sens.shapes[n][0] * sens.shapes[n][1], chosen[n].bits, chosen[n].name,
                              costs[i][allocation.choice[i]] // 8,
                              dict(zip([s.name for s in schemes], sens.losses[n], strict=True)))
                  for i, n in enumerate(names)]
        predicted = {"avg_bits": allocation.cost / weights, "quantized_bytes": allocation.cost // 8,
                     "tensor_bytes": sens.fixed_bytes + allocation.cost // 8, "loss": allocation.loss,
                     "objective": allocation.objective, "optimal": allocation.exact}
        elapsed = sens.measure_s + time.perf_counter() - start
        log.info("plan for %s over %d layers: %.3f bits per weight, predicted loss %.4g", budget.label(),
                 len(names), predicted["avg_bits"], allocation.loss)
        return SearchResult(_plan(chosen), self, budget, layers, predicted, elapsed)


@dataclass(frozen=True)
class Sensitivities:
    layers: tuple[str, ...]  # searched linear layers, in model order
    shapes: dict[str, tuple[int, int]]  # weight [out, in] per layer
    losses: dict[str, list[float]]  # loss per candidate (increasing bits) per layer
    fixed_bytes: int  # what every other stored tensor takes
    measure_s: float


@dataclass(frozen=True)
class LayerChoice:
    name: str
    weights: int
    bits: int
    scheme: str  # the chosen candidate's name
    bytes: int  # stored bytes at the chosen candidate
    loss: dict[str, float]  # sensitivity per candidate, by scheme name


@dataclass
class SearchResult:
    plan: Plan
    search: MixedPrecisionSearch
    budget: Budget
    layers: list[LayerChoice]
    predicted: dict
    search_s: float
    measured: dict = field(default_factory=dict)  # filled by a verification run (quantize + evaluate)

    def to_dict(self) -> dict:
        """The plan (what `Plan.load` reads) with the search's settings, choices and predictions beside it."""
        return self.plan.to_dict() | {"search": {
            "config": asdict(self.search), "budget": asdict(self.budget), "search_s": self.search_s,
            "predicted": self.predicted, "measured": self.measured,
            "layers": [asdict(layer) for layer in self.layers]}}

    def save(self, path: str | Path, force: bool = False) -> Path:
        check_output(Path(path), force)
        return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(self.to_dict(), indent=2)))

    def bits_histogram(self) -> dict[int, int]:
        """Quantized weights per chosen bit width."""
        counts: dict[int, int] = {}
        for layer in self.layers:
            counts[layer.bits] = counts.get(layer.bits, 0) + layer.weights
        return dict(sorted(counts.items()))

    def scheme_histogram(self) -> dict[str, int]:
        """Quantized weights per chosen candidate, in the order of the candidates."""
        counts = {scheme.name: 0 for scheme in self.search.schemes()}
        for layer in self.layers:
            counts[layer.scheme] += layer.weights
        return {name: n for name, n in counts.items() if n}


def _searched_layers(model: nn.Module) -> list[str]:
    """The linear layers inside the transformer blocks, in model order (what a uniform plan quantizes)."""
    prefix = arch_for(model).blocks + "."
    return [n for n in Plan.uniform(QuantScheme(8)).resolve(model) if n.startswith(prefix)]


def _fixed_bytes(model: nn.Module, names: list[str], keep_fp32: bool) -> int:
    """Bytes of every stored tensor except the searched layers' weights, as the checkpoint stores them."""
    tensors, _ = stored_tensors(model, torch.float32 if keep_fp32 else torch.float16)
    searched = {f"{n}.weight" for n in names}
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if name not in searched)


def _plan(chosen: dict[str, QuantScheme]) -> Plan:
    return Plan(tuple(Rule(re.escape(name), scheme) for name, scheme in chosen.items()))
