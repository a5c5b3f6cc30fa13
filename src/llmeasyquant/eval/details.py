"""What the comparison figures need beyond perplexity, measured per row of a comparison: speed and its latency
breakdown, block output errors, a weight histogram, per-layer summaries, perplexity over context length."""

from __future__ import annotations

import torch
from torch import nn

from llmeasyquant.eval.layer_stats import (
    block_output_errors,
    context_perplexities,
    representative_layer,
    weight_histogram,
    weight_summaries,
)
from llmeasyquant.eval.perplexity import EvalWindows
from llmeasyquant.eval.speed import generation_speed, latency_breakdown
from llmeasyquant.nn.qlinear import quantized_layers

PROMPT_TOKENS = 128  # the house speed protocol: batch 1, a 128-token prompt, 64 greedy new tokens
NEW_TOKENS = 64
PROFILED_TOKENS = 16
CONTEXT_LENGTHS = (128, 256, 512, 1024)
CONTEXT_WINDOWS = 4


def details_protocol() -> dict:
    return {"speed": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "batch": 1, "greedy": True,
                      "threads": torch.get_num_threads(), "profiled_tokens": PROFILED_TOKENS},
            "context_lengths": list(CONTEXT_LENGTHS), "context_windows": CONTEXT_WINDOWS,
            "block_errors": "relative output error of each block on the first evaluation window"}


def measure_details(reference: nn.Module, model: nn.Module, windows: EvalWindows) -> dict:
    """The optional compare-record fields (docs/compare_record.md) for `model`; `reference` is the unquantized one
    (pass it as `model` too for the fp32 row)."""
    prompt = windows.ids[:1, :PROMPT_TOKENS]
    # The loop `bench` times by default: the lean one where the family has it, so compare and bench agree.
    row = generation_speed(model, prompt, NEW_TOKENS, runtime="auto")
    row["latency"] = latency_breakdown(model, prompt, PROFILED_TOKENS, runtime="auto")
    row["context_ppl"] = context_perplexities(model, windows.ids.flatten(), CONTEXT_LENGTHS, CONTEXT_WINDOWS)
    if quantized_layers(model):
        errors = block_output_errors(reference, model, windows.ids[0])
        row["layer_errors"] = errors
        row["weight_hist"] = weight_histogram(reference, model, representative_layer(model))
        row["weight_summaries"] = weight_summaries(model, errors)
    return row
