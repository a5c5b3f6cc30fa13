"""Choosing the next token of every sequence of a step at once: greedy, or sampled with temperature, top-k and top-p,
after each request's logit_bias and penalties, with the log probabilities of the rows that ask for them.

`choose_tokens` takes the step's logits [rows, vocab] and one `RequestSampler` per row, and does a constant number
of tensor operations however many rows there are (the engine's decode step must not cost interpreted work per
sequence): the offsets of the rows that have a bias or penalties are added in one operation, greedy rows take the
argmax of that, the sampled rows are divided by their temperatures, masked by their top-k and top-p together and
chosen by inverse CDF: one cumulative sum over the batch and one search for each row's uniform number.

Each sampled request draws exactly one uniform number a step from its own seeded generator, so its tokens depend on
its seed alone, never on what else runs in the batch (every operation above works row by row), and a request
repeats with its seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from llmeasyquant.runtime.requests import SamplingParams, TokenLogprob

Choices = tuple[list[int], list[TokenLogprob | None]]  # a step's tokens, and the log probabilities asked for


class RequestSampler:
    """One request's sampling state: its params, its seeded generator (sampled requests only) and, for requests
    with a logit_bias or penalties, the `offset` [vocab] added to its row of logits.

    The bias is set in the offset once, and each generated token's entry is rewritten (bias - presence_penalty -
    frequency_penalty * count) as it is counted, so a step costs the request nothing per token of its completion.
    `seed` None: a seed from the operating system (not reproducible)."""

    def __init__(self, params: SamplingParams, vocab_size: int, seed: int | None = None) -> None:
        self.params = params
        # Python's generator: a draw costs a fraction of a torch call. It would take a negative seed's absolute
        # value (-5 repeating 5); modulo 2**64, as torch.Generator.manual_seed reads a seed, the two differ.
        self.rng = None if params.greedy else random.Random(None if seed is None else seed % 2**64)
        self.offset: torch.Tensor | None = None
        self.bias: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        if params.shapes_logits:
            self.offset = torch.zeros(vocab_size, dtype=torch.float32)
            for token, bias in params.logit_bias:  # a token named twice: the last bias counts, as in a JSON map
                self.bias[token] = float(bias)
                self.offset[token] = float(bias)
        self.penalised = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    def count(self, token: int) -> None:
        """Take a generated token into the penalties of the next steps."""
        if not self.penalised:
            return
        times = self.counts[token] = self.counts.get(token, 0) + 1
        penalty = self.params.presence_penalty + self.params.frequency_penalty * times
        self.offset[token] = self.bias.get(token, 0.0) - penalty

    def uniform(self) -> float:
        """This step's uniform number in [0, 1) (sampled requests only)."""
        return self.rng.random()


def choose_tokens(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> Choices:
    """The next token of each row of logits [rows, vocab] (fp32), row i decoded as samplers[i] says, and its log
    probability for the rows whose requests ask (None for the others; offset 0: the caller sets where the token's
    text starts). The penalised rows count their tokens for the next steps."""
    if not samplers:  # a step of prompt chunks alone
        return [], []
    shaped = _shaped(logits, samplers)
    tokens = _chosen(shaped, samplers)
    for index in [i for i, s in enumerate(samplers) if s.penalised]:
        samplers[index].count(tokens[index])
    return tokens, _logprobs(shaped, samplers, tokens)


def _shaped(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """The logits the choice and the log probabilities are made from: logits + bias - penalties, added in one
    operation for the rows that have an offset (the others, and the step's logits, are left as they are)."""
    rows = [i for i, s in enumerate(samplers) if s.offset is not None]
    if not rows:
        return logits
    return logits.index_add(0, torch.tensor(rows), torch.stack([samplers[i].offset for i in rows]))


def _chosen(shaped: torch.Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """Greedy rows: the argmax; the others sampled."""
    sampled = [i for i, s in enumerate(samplers) if s.rng is not None]
    if not sampled:
        return shaped.argmax(-1).tolist()
    picks = _sampled(_rows(shaped, sampled), [samplers[i] for i in sampled])
    if len(sampled) == len(samplers):
        return picks.tolist()
    return shaped.argmax(-1).index_copy_(0, torch.tensor(sampled), picks).tolist()


def _sampled(scores: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """One token per row of scores [rows, vocab] by temperature, top-k and top-p, drawn by inverse CDF with each
    row's uniform number."""
    params = [s.params for s in samplers]
    scores = scores / torch.tensor([[p.temperature] for p in params])
    vocab = scores.shape[-1]
    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if k_rows:
        scores = _on_rows(scores, k_rows, lambda rows: _top_k(rows, [params[i].top_k for i in k_rows]))
    probs = scores.softmax(-1)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        probs = _on_rows(probs, p_rows, lambda rows: _top_p(rows, [params[i].top_p for i in p_rows]))
    uniforms = torch.tensor([[s.uniform()] for s in samplers])
    return _inverse_cdf(probs, uniforms)


def _top_k(scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Each row's scores below its k-th largest masked out (`ks`: each row's k). One topk at the largest k: a
    row's k-th value is the same whatever the others' k."""
    kth = torch.tensor([[k - 1] for k in ks])
    threshold = scores.topk(max(ks), dim=-1).values.gather(-1, kth)
    return scores.masked_fill(scores < threshold, -torch.inf)


def _top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Each row's probabilities outside its nucleus zeroed (`top_ps`: each row's top_p): the smallest prefix of its
    tokens, likeliest first, whose mass reaches top_p; a token is dropped when the mass before it does."""
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    before = ordered.cumsum(-1) - ordered
    dropped = before >= torch.tensor([[top_p] for top_p in top_ps])
    return torch.zeros_like(probs).scatter_(-1, order, ordered.masked_fill(dropped, 0.0))


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token at its uniform number's place in the row's cumulative distribution (`probs` [rows, vocab],
    not necessarily normalised; `uniforms` [rows, 1] in [0, 1]).

    A token of probability 0 is never chosen: the search takes the first place where the running sum passes the
    target, and a zero adds nothing to the sum (torch sums a row in order, in float64, rounding each partial sum
    to float32: the sums never go down, and a zero leaves the next one equal); the target stays below the row's
    total even when rounding (a uniform of 1 - 2**-53 is 1.0 in float32) would put it there. (float32 sums: a
    float64 cumsum costs several times as much on a large vocabulary.)"""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    if bool((tokens == probs.shape[-1]).any()):  # only a NaN target passes the last token: fail the step
        raise ValueError("a row's probabilities are not finite (the model gave NaN or infinite logits)")
    return tokens


def _on_rows(values: torch.Tensor, rows: list[int], change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`values` with `change` made to some of its rows (`rows`, in order) and the others as they are."""
    if len(rows) == len(values):
        return change(values)
    index = torch.tensor(rows)
    return values.index_copy(0, index, change(values[index]))


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Those rows of `values` (no copy when they are all of them)."""
    return values if len(rows) == len(values) else values[torch.tensor(rows)]


def _logprobs(shaped: torch.Tensor, samplers: Sequence[RequestSampler],
              tokens: list[int]) -> list[TokenLogprob | None]:
    """The log probabilities of the rows that ask, from one log-softmax over those rows of the shaped logits (before
    temperature, top-k and top-p)."""
    asking = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(samplers)
    if asking:
        entries = token_logprobs(_rows(shaped, asking), [tokens[i] for i in asking],
                                 [samplers[i].params.logprobs for i in asking], [0] * len(asking))
        for index, entry in zip(asking, entries, strict=True):
            out[index] = entry
    return out


def token_logprobs(logits: torch.Tensor, targets: list[int], top: int | Sequence[int],
                   offsets: list[int]) -> list[TokenLogprob]:
    """Each row's log probability of its target token under log_softmax(logits [rows, vocab]) and the row's `top`
    likeliest tokens (most likely first; one count for every row, or one per row), in one pass over the rows (a
    prompt chunk's positions, or the rows of a step that ask); `offsets` where each target's text starts."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1).tolist()
    tops = [top] * len(targets) if isinstance(top, int) else list(top)
    alternatives: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if max(tops, default=0):
        values, ids = logprobs.topk(min(max(tops), logprobs.shape[-1]), dim=-1)
        alternatives = [tuple(zip(row_ids[:count], row_values[:count], strict=True))
                        for row_ids, row_values, count in zip(ids.tolist(), values.tolist(), tops, strict=True)]
    return [TokenLogprob(token, value, alt, offset)
            for token, value, alt, offset in zip(targets, chosen, alternatives, offsets, strict=True)]
