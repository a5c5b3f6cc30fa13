"""The check after an export: load the exported file in its own runtime, run the evaluation windows, and compare
the perplexity and the logits with our evaluation of the same quantized model on the same windows."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmeasyquant.eval.perplexity import EvalWindows
from llmeasyquant.export.common import MissingRuntimeError, Stopwatch
from llmeasyquant.export.formats import export_format
from llmeasyquant.kernels import REFERENCE
from llmeasyquant.nn.qlinear import forced_kernel

log = logging.getLogger(__name__)


def _nll_sum(logits: torch.Tensor, window: torch.Tensor) -> float:
    """Summed NLL of the window's next tokens under logits [seqlen, vocab]."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return -float(logprobs.gather(-1, window[1:, None]).sum())


@torch.no_grad()
def check_export(path: str | Path, to: str, model: nn.Module, windows: EvalWindows, threads: int | None = None,
                 progress: bool = True) -> dict:
    """Metrics of the exported file in its runtime beside ours: ppl of each, their relative difference, the
    largest logit difference, and the runtime's load time. {'skipped': why} when the runtime is not installed.

    Ours runs on the reference kernel (fp32, the arithmetic every export follows), so that a difference measures
    the export and the runtime, not our faster kernels' bf16 rounding."""
    fmt = export_format(to)
    clock = Stopwatch()
    try:
        runtime = fmt.open_runtime(Path(path).expanduser(), windows.ids.shape[1], threads)
    except MissingRuntimeError as exc:
        log.warning("check skipped: %s", exc)
        return {"runtime": fmt.runtime, "skipped": str(exc)}
    load_s = clock.seconds()
    ours = theirs = 0.0
    max_diff = 0.0
    run_s = 0.0
    for window in tqdm(windows.ids, desc=f"checking in {fmt.runtime}", unit="window", disable=not progress):
        with forced_kernel(model, REFERENCE.name):
            ref = model(window.unsqueeze(0), use_cache=False).logits[0].float()
        start = Stopwatch()
        got = runtime(window).float()
        run_s += start.seconds()
        ours += _nll_sum(ref, window)
        theirs += _nll_sum(got, window)
        max_diff = max(max_diff, float((got - ref).abs().max()))
    tokens = windows.ids.shape[0] * (windows.ids.shape[1] - 1)
    ppl_ours, ppl_runtime = math.exp(ours / tokens), math.exp(theirs / tokens)
    return {"runtime": fmt.runtime, "ppl_ours": ppl_ours, "ppl_runtime": ppl_runtime,
            "ppl_rel_diff_pct": 100 * (ppl_runtime / ppl_ours - 1), "max_abs_logit_diff": max_diff,
            "load_s": load_s, "runtime_eval_s": run_s, "windows": int(windows.ids.shape[0]), "tokens": tokens}
