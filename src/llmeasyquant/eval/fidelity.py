"""Fidelity against the unquantized model on the same windows: KL(P_ref || P_quant) and top-1 agreement."""

from __future__ import annotations

import math

import torch


def kl_sum(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Sum over positions of KL(P_ref || P) for log-probabilities [positions, vocab]: per position (a reduction along
    the vocabulary, the same at any thread count), then math.fsum over positions (a whole-tensor sum is split by
    thread count, and one process and the ranks of a distributed evaluation must agree)."""
    return math.fsum((ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).tolist())


def top1_matches(ref_logits: torch.Tensor, logits: torch.Tensor) -> int:
    """Positions where both models rank the same token first."""
    return int((ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)).sum())
