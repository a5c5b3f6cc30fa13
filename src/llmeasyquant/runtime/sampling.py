"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p, each request on its
own seeded generator (so its tokens do not depend on what else runs in the batch).

Requests that ask for more (logit_bias, presence or frequency penalties, log probabilities) get a `RequestSampler`
of their own, which shapes their row of logits before the same choice and reads the log probabilities off it; the
others never pay for it (the engine decodes them with `sample` and `greedy_tokens` alone).
"""

from __future__ import annotations

import torch

from llmeasyquant.runtime.requests import SamplingParams, TokenLogprob


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id from logits [vocab] (fp32)."""
    if params.greedy:
        return int(logits.argmax())
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    probs = scores.softmax(-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass before it does.
        before = ordered.cumsum(-1) - ordered
        ordered = ordered.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """argmax of each row of logits [rows, vocab], in one operator."""
    return logits.argmax(dim=-1).tolist()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log probability of `token` under log_softmax(logits [vocab]) and the `top` likeliest tokens, most likely
    first (offset 0: the engine sets where the token's text starts)."""
    return token_logprobs(logits.unsqueeze(0), [token], top, [0])[0]


def token_logprobs(logits: torch.Tensor, targets: list[int], top: int, offsets: list[int]) -> list[TokenLogprob]:
    """Each row's log probability of its target token under log_softmax(logits [rows, vocab]) and the row's `top`
    likeliest tokens (most likely first), in one pass over the rows (a prompt chunk's positions, or one generated
    token's); `offsets` where each target's text starts."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1).tolist()
    alternatives: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        alternatives = [tuple(zip(row_ids, row_values, strict=True))
                        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenLogprob(token, value, alt, offset)
            for token, value, alt, offset in zip(targets, chosen, alternatives, offsets, strict=True)]


class RequestSampler:
    """One request's logit_bias and penalties, and its choice of token with its log probability.

    The bias and the penalties live in one `offset` [vocab] added to the step's logits: the bias set once, and
    each generated token's entry rewritten (bias - presence_penalty - frequency_penalty * count) as it is counted,
    so a step costs one add over the vocabulary whatever the length of the completion."""

    def __init__(self, params: SamplingParams, vocab_size: int, generator: torch.Generator | None) -> None:
        self.params, self.generator = params, generator
        self.offset: torch.Tensor | None = None
        self.bias: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        if params.shapes_logits:
            self.offset = torch.zeros(vocab_size, dtype=torch.float32)
            for token, bias in params.logit_bias:  # a token named twice: the last bias counts, as in a JSON map
                self.bias[token] = float(bias)
                self.offset[token] = float(bias)
        self.penalised = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] the choice and the log probabilities are made from: logits + bias - penalties."""
        return logits if self.offset is None else logits + self.offset

    def count(self, token: int) -> None:
        """Take a generated token into the penalties of the next steps."""
        if not self.penalised:
            return
        times = self.counts[token] = self.counts.get(token, 0) + 1
        penalty = self.params.presence_penalty + self.params.frequency_penalty * times
        self.offset[token] = self.bias.get(token, 0.0) - penalty

    def next(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from the row of logits [vocab], and its log probability when the request asked."""
        shaped = self.shape(logits)
        token = int(shaped.argmax()) if self.params.greedy else sample(shaped, self.params, self.generator)
        self.count(token)
        logprob = None if self.params.logprobs is None else token_logprob(shaped, token, self.params.logprobs)
        return token, logprob
