"""Input statistics of a block's linear layers from one forward pass over its calibration inputs.

Linears that read the same tensor (q, k and v; gate and up) share one accumulation: the statistic is computed once
and handed to each of them. The sequential runner collects them during the pass that computes the float block's
outputs, so the first method of a recipe gets them without a pass of its own.

Each linear's count of calibration tokens is kept beside its statistics: a mixture of experts' expert reads only the
tokens routed to it, possibly none (such layers are named by `routed` prefixes; the methods fall back for those that
read too few, see methods/base.py `short_of_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.infra import distributed
from llmeasyquant.infra.exact_sum import exact_totals
from llmeasyquant.methods.gram import ExactGram
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.nn.transform import transformed_input

STATS = frozenset({"hessian", "range"})


@dataclass
class InputStats:
    hessian: dict[str, torch.Tensor]  # H = 2/n · Σ x xᵀ [in, in] fp32 over every calibration token (an exact sum)
    lo: dict[str, torch.Tensor]  # min x per input channel [in]
    hi: dict[str, torch.Tensor]  # max x per input channel [in]
    kinds: frozenset[str] = STATS  # which of the two were collected
    tokens: dict[str, int] = field(default_factory=dict)  # calibration tokens each linear read (0: none reached it)

    @property
    def absmax(self) -> dict[str, torch.Tensor]:
        """max |x| per input channel [in]."""
        return {name: torch.maximum(-self.lo[name], self.hi[name]) for name in self.lo}

    def pooled(self, names: list[str] | tuple[str, ...], routed: tuple[str, ...]) -> InputStats:
        """The statistics of what a group of linears that read one stream reads, under the group's first name.

        When none of them is routed they all read the same tensor: the first one's own (these statistics). When
        some are (a mixture of experts' experts, each reading the tokens routed to it), pooled over those that read
        any, weighted by their tokens: every token reaches top-k experts (and the shared ones), so the pool is
        exactly the statistics of the stream."""
        if not any(n.startswith(routed) for n in names):
            return self
        read = [n for n in names if self.tokens.get(n, 0) > 0]
        first, total = names[0], sum(self.tokens.get(n, 0) for n in read)
        hessian, lo, hi, tokens = dict(self.hessian), dict(self.lo), dict(self.hi), dict(self.tokens)
        tokens[first] = total
        if read and all(n in self.hessian for n in read):
            hessian[first] = (sum(self.hessian[n].double() * self.tokens[n] for n in read) / total).float()
        if read and all(n in self.lo for n in read):
            lo[first] = torch.stack([self.lo[n] for n in read]).amin(dim=0)
            hi[first] = torch.stack([self.hi[n] for n in read]).amax(dim=0)
        return InputStats(hessian=hessian, lo=lo, hi=hi, kinds=self.kinds, tokens=tokens)

    def divided(self, names: list[str], scales: torch.Tensor) -> InputStats:
        """The statistics once the inputs of `names` are divided channel-wise by `scales` [in] (as SmoothQuant
        and AWQ do), computed from these ones instead of by another pass over the data."""
        hessian, lo, hi = dict(self.hessian), dict(self.lo), dict(self.hi)
        done: dict[int, torch.Tensor] = {}  # linears that read one input share one H: divided once, still shared
        for name in names:
            if name in hessian:
                h = self.hessian[name]
                if id(h) not in done:
                    done[id(h)] = (h / scales[:, None]).div_(scales[None, :])  # one new matrix, not two
                hessian[name] = done[id(h)]
            if name in lo:
                lo[name], hi[name] = self.lo[name] / scales, self.hi[name] / scales
        return InputStats(hessian=hessian, lo=lo, hi=hi, kinds=self.kinds, tokens=self.tokens)


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
                        keep_outputs: bool = False, want: frozenset[str] = STATS, routed: tuple[str, ...] = ()
                        ) -> tuple[InputStats, list[torch.Tensor] | None]:
    """Statistics of what each named linear reads, and (optionally) the block's outputs, from one pass.

    `want` picks the statistics ("hessian", "range"): a Hessian costs a GEMM per input, so only those who use it
    pay for it; the others come back empty. Names starting with one of the `routed` prefixes (a mixture of experts'
    experts) may read no token: they get a count of 0 and no statistics; any other name that reads none is an
    error."""
    sums: dict[str, ExactGram] = {}
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
                # Each batch's products alone (in fp32, the same on whichever rank holds the batch), summed exactly
                # in bounded memory: the order of the batches, and how they are split over ranks, changes no bit of H.
                if name not in sums:
                    sums[name] = ExactGram(flat.shape[1])
                sums[name].add(flat)
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
    missing = [n for n in names if n not in counts and n not in alias and not n.startswith(routed)]
    if missing:
        raise RuntimeError(f"no calibration input reached {missing}; the block's forward never called them")
    # Under torch.distributed each rank saw its share of the batches: sum the statistics over ranks (in the order
    # the hooks fired, which every rank shares) so that all of them hold the statistics of all the data. Counts
    # are integers, minima and maxima exact, and the Gram sums exact: the result is the single process's, bit for bit.
    hessian = {}
    for name in counts:
        counts[name] = int(distributed.all_reduce(torch.tensor(counts[name], dtype=torch.int64)))
        if name in sums:
            hessian[name] = 2 * sums.pop(name).reduce(counts[name])  # x2 is exact: the bits of 2 Σ / n in fp64
        if name in lo:
            lo[name], hi[name] = distributed.all_reduce(lo[name], "min"), distributed.all_reduce(hi[name], "max")
    for name, owner in alias.items():
        if owner in hessian:
            hessian[name] = hessian[owner]
        if owner in lo:
            lo[name], hi[name] = lo[owner], hi[owner]
    tokens = {name: counts.get(alias.get(name, name), 0) for name in names}
    return InputStats(hessian=hessian, lo=lo, hi=hi, kinds=frozenset(want), tokens=tokens), outputs


def static_input_layers(block: nn.Module) -> dict[str, QuantLinear]:
    """The block's quantized linears whose activations take a static (calibrated) scale."""
    return {name: m for name, m in block.named_modules() if isinstance(m, QuantLinear) and m.static_input}


@torch.no_grad()
def calibrate_static_inputs(block: nn.Module, stats: InputStats | None, inputs: list[torch.Tensor],
                            kwargs: list[dict], routed: tuple[str, ...] = ()) -> list[str]:
    """Set the static activation scale of each such layer from the range of its calibration inputs; returns the
    layers that took a pooled range instead (see `_pooled_range`).

    The ranges come from `stats` when they hold them (the float block's inputs, kept exact through smoothing),
    otherwise from one pass over the quantized block with those layers scaling their inputs on the fly."""
    layers = static_input_layers(block)
    if not layers:
        return []
    needed = {name for name in layers if not name.startswith(routed)}
    if stats is None or "range" not in stats.kinds or not needed <= set(stats.lo):
        for layer in layers.values():
            layer.observing = True
        try:
            stats, _ = collect_input_stats(block, list(layers), inputs, kwargs, want=frozenset({"range"}),
                                           routed=routed)
        finally:
            for layer in layers.values():
                layer.observing = False
    pooled = []
    for name, layer in layers.items():
        if name in stats.lo:
            layer.set_input_range(float(stats.lo[name].min()), float(stats.hi[name].max()))
        else:
            layer.set_input_range(*_pooled_range(name, stats, routed))
            pooled.append(name)
    return pooled


def expert_role(name: str, routed: tuple[str, ...]) -> str | None:
    """'mlp.experts.3.down_proj' -> 'mlp.experts.*.down_proj': what the same linear of every expert shares."""
    prefix = next((p for p in routed if name.startswith(p)), None)
    if prefix is None:
        return None
    _index, _, rest = name[len(prefix):].partition(".")
    return f"{prefix}*.{rest}"


def _pooled_range(name: str, stats: InputStats, routed: tuple[str, ...]) -> tuple[float, float]:
    """An expert no calibration token reached takes the range of what the same linear of the block's other experts
    read (the gate/up projections all read the post-attention norm's output)."""
    role = expert_role(name, routed)
    peers = [n for n in stats.lo if role is not None and expert_role(n, routed) == role]
    if not peers:
        raise ConfigError(f"no calibration token reached any {role or name}, so no static activation scale can be "
                          "set for it: give more calibration samples or use dynamic activations")
    return (min(float(stats.lo[n].min()) for n in peers), max(float(stats.hi[n].max()) for n in peers))
