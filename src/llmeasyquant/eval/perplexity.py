"""Protocol-explicit perplexity, and the window loop that also measures fidelity against a reference model.

Protocol: the text is tokenized once without BOS, cut into non-overlapping windows of `seqlen`
tokens (last partial window dropped, first `max_windows` kept); every position but the last of a window predicts
the next token; ppl = exp(mean NLL over all predicted tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmeasyquant.calibration.data import TextSource, consecutive_chunks, tokenize
from llmeasyquant.eval.fidelity import kl_sum, top1_matches
from llmeasyquant.infra import distributed
from llmeasyquant.infra.exact_sum import exact_totals


@dataclass(frozen=True)
class EvalWindows:
    ids: torch.Tensor  # [windows, seqlen]
    protocol: dict  # text_sha256, text_source, text_kind, seqlen, max_windows, windows, bos, tokenizer


def tokenizer_name(tokenizer: object) -> str:
    """The tokenizer's hub id or folder name: a record names what was used, not where this machine keeps it."""
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    return Path(name).name if Path(name).is_absolute() else name


def make_windows(tokenizer: object, source: TextSource, seqlen: int = 512,
                 max_windows: int | None = None) -> EvalWindows:
    if max_windows is not None and max_windows <= 0:
        raise ValueError(f"max_windows must be positive, got {max_windows}")
    ids = consecutive_chunks(tokenize(tokenizer, source.text), seqlen, max_windows)
    protocol = {
        "text_source": source.description, "text_kind": source.kind, "text_sha256": source.sha256,
        "seqlen": seqlen, "max_windows": max_windows, "windows": ids.shape[0], "bos": False,
        "tokenizer": tokenizer_name(tokenizer),
    }
    return EvalWindows(ids=ids, protocol=protocol)


@dataclass
class _Totals:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    windows: list[tuple[float, float]] = field(default_factory=list)  # (NLL, KL) of each window, summed exactly


CacheFactory = Callable[[], object]  # a fresh transformers Cache per window


def _logits(model: nn.Module, window: torch.Tensor, new_cache: CacheFactory | None = None
            ) -> tuple[torch.Tensor, float]:
    """Logits [seqlen - 1, vocab] in fp32 for the positions that predict a next token, and the seconds taken.

    With `new_cache`, the window's keys and values go through that cache (written, then read back by attention),
    so a quantized cache's error reaches the logits."""
    start = time.perf_counter()
    if new_cache is None:
        out = model(window.unsqueeze(0), use_cache=False)
    else:
        out = model(window.unsqueeze(0), past_key_values=new_cache(), use_cache=True)
    return out.logits[0, :-1].float(), time.perf_counter() - start


@torch.no_grad()
def evaluate_windows(models: dict[str, nn.Module], windows: EvalWindows, reference: str | None = None,
                     progress: bool = True, caches: dict[str, CacheFactory] | None = None
                     ) -> dict[str, dict[str, float]]:
    """Run every model on every window. Metrics per model: ppl, nll, tokens, windows, eval_s, and, when
    `reference` names one of `models`, kld and top1 against it. `caches` names the models whose windows run
    through a KV cache (a factory giving a fresh one per window), e.g. a quantized cache."""
    caches = caches or {}
    if reference is not None and reference not in models:
        raise ValueError(f"reference {reference!r} is not among the models {list(models)}")
    totals = {name: _Totals() for name in models}
    # Under torch.distributed each rank evaluates its share of the windows; the sums are all-reduced below.
    bar = tqdm(windows.ids[distributed.shard(windows.ids.shape[0])], desc="evaluating windows", unit="window",
               disable=not progress)
    for window in bar:
        targets = window[1:]
        ref_logits = ref_logprobs = None
        if reference is not None:
            ref_logits, seconds = _logits(models[reference], window, caches.get(reference))
            ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
            totals[reference].seconds += seconds
        for name, model in models.items():
            if name == reference:
                logits, logprobs = ref_logits, ref_logprobs
            else:
                logits, seconds = _logits(model, window, caches.get(name))
                logprobs = torch.log_softmax(logits, dim=-1)
                totals[name].seconds += seconds
            t = totals[name]
            nll = -math.fsum(logprobs.gather(-1, targets[:, None]).flatten().tolist())
            kl = kl_sum(ref_logprobs, logprobs) if ref_logprobs is not None else 0.0
            t.windows.append((nll, kl))
            t.nll += nll  # the running figure shown in progress; the result is the exact sum below
            t.tokens += targets.numel()
            if ref_logprobs is not None:
                t.top1 += top1_matches(ref_logits, logits)
        if reference is None and len(models) == 1:
            only = next(iter(totals.values()))
            bar.set_postfix(ppl=f"{math.exp(only.nll / only.tokens):.3f}")
    for t in totals.values():
        # Exact sums over windows (and ranks): the same bits whichever rank evaluated which window.
        t.nll, t.kl = exact_totals(t.windows, 2)
        counts = distributed.all_reduce(torch.tensor([t.top1, t.tokens], dtype=torch.int64)).tolist()
        t.top1, t.tokens = int(counts[0]), int(counts[1])
        t.seconds = float(distributed.all_reduce(torch.tensor(t.seconds, dtype=torch.float64), "max"))
    results = {}
    for name, t in totals.items():
        metrics = {"ppl": math.exp(t.nll / t.tokens), "nll": t.nll / t.tokens, "tokens": t.tokens,
                   "windows": int(windows.ids.shape[0]), "eval_s": t.seconds}
        if reference is not None:
            metrics["kld"] = t.kl / t.tokens
            metrics["top1"] = t.top1 / t.tokens
        results[name] = metrics
    return results


def perplexity(model: nn.Module, windows: EvalWindows, progress: bool = True,
               new_cache: CacheFactory | None = None) -> dict[str, float]:
    caches = {"model": new_cache} if new_cache is not None else None
    return evaluate_windows({"model": model}, windows, progress=progress, caches=caches)["model"]
