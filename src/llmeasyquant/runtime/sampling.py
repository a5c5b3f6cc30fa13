"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p, each request on its
own seeded generator (so its tokens do not depend on what else runs in the batch)."""

from __future__ import annotations

import torch

from llmeasyquant.runtime.requests import SamplingParams


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
