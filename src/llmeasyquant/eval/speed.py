"""Speed under the house protocol (batch 1, a 128-token prompt, greedy new tokens) and where decode time goes.

The latency breakdown profiles the steps of a short greedy decode (not its prefill) with the PyTorch profiler and
splits the CPU time into "gemm" (the matrix-multiply operators, integer or float, self time), "quant" (activation
quantization inside the integer layers), "load" (unpacking or dequantizing stored weights, and the kernels'
one-time preparation) and "other" (everything else: attention, norms, the Python around them), for the whole
model and per quantized layer kind. On one process there is no communication or synchronisation time; those
columns of the paper's Table 5 are absent rather than zero-filled.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from llmeasyquant.kernels.scopes import LAYER_SCOPE, LOAD_WEIGHTS, NATIVE_GEMM, QUANTIZE_ACTIVATIONS
from llmeasyquant.models.arch import arch_for
from llmeasyquant.runtime.batch import BatchDecoder
from llmeasyquant.runtime.decoder import LeanDecoder, sequence_pool
from llmeasyquant.runtime.model_parts import DecoderParts

GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm", "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu", NATIVE_GEMM,
})
# Scopes the kernels open (kernels/scopes.py): their inclusive time minus the GEMMs inside them.
SCOPES = {"load": LOAD_WEIGHTS, "quant": QUANTIZE_ACTIVATIONS}


RUNTIMES = ("auto", "lean", "lean-pytorch", "transformers")  # lean-pytorch: the lean loop without fused operators


def resolve_runtime(model: nn.Module, runtime: str) -> str:
    """"auto" -> "lean" where the model's family has a lean-loop map in the arch table, else "transformers"."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime != "auto":
        return runtime
    return "lean" if arch_for(model).decoder is not None else "transformers"


def _fill_cache(model: nn.Module, prompt: torch.Tensor) -> object:
    """The prefill as generation runs it: the cache filled, logits for the last position only (the LM head over
    every prompt position would be most of a small model's prefill, for logits nobody reads)."""
    try:
        return model(prompt, use_cache=True, logits_to_keep=1)
    except TypeError:  # a model class without the argument
        return model(prompt, use_cache=True)


class Greedy:
    """Greedy batch-1 generation on one runtime: "transformers" (the model's own forward and cache), "lean"
    (runtime/decoder.py: a static cache, a short operator path and the fused C++ operators where they build),
    "lean-pytorch" (the same loop on PyTorch operators only) or "auto" (lean where it applies). Built
    before timing starts, so that only the prefill and the steps are timed."""

    def __init__(self, model: nn.Module, runtime: str, max_tokens: int) -> None:
        runtime = resolve_runtime(model, runtime)
        self.model, self.runtime = model, runtime
        lean = runtime.startswith("lean")
        self.decoder = LeanDecoder(model, max_tokens, fused=runtime == "lean") if lean else None
        self.past: object = None

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Fill the cache with prompt [1, P]; the first chosen token."""
        if self.decoder is not None:
            self.decoder.reset()
            return self.decoder.prefill(prompt).argmax()
        out = _fill_cache(self.model, prompt)
        self.past = out.past_key_values
        return out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append `token`; the next chosen token."""
        if self.decoder is not None:
            return self.decoder.step(token).argmax()
        out = self.model(token.reshape(1, 1), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[:, -1:].argmax(-1)


def timed_greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int, runtime: str) -> tuple[float, float]:
    """Seconds of the prefill and of the `new_tokens - 1` decode steps after it."""
    run = Greedy(model, runtime, prompt.shape[1] + new_tokens)
    start = time.perf_counter()
    token = run.prefill(prompt)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = run.step(token)
    return prefill_s, time.perf_counter() - start


def generation_speed(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 64, warmup: int = 4,
                     runtime: str = "transformers") -> dict:
    """Prefill and decode tokens per second for `prompt` [1, P] and `new_tokens` greedy tokens, after a warm-up."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time a decode step, got {new_tokens}")
    runtime = resolve_runtime(model, runtime)
    timed_greedy(model, prompt, warmup, runtime)  # first calls prepare kernels and allocate, at the prompt's own length
    prefill_s, decode_s = timed_greedy(model, prompt, new_tokens, runtime)
    return {"prefill_tok_s": prompt.shape[1] / prefill_s, "decode_tok_s": (new_tokens - 1) / decode_s,
            "prompt_tokens": int(prompt.shape[1]), "new_tokens": new_tokens, "runtime": runtime}


def prefill_speed(model: nn.Module, prompt: torch.Tensor, runtime: str = "transformers") -> float:
    """Tokens per second of one forward pass over `prompt` [1, P] that fills the cache (after a warm-up)."""
    run = Greedy(model, runtime, prompt.shape[1])
    run.prefill(prompt)  # the first call at a new length pays one-time costs (allocation, packing)
    start = time.perf_counter()
    run.prefill(prompt)
    return prompt.shape[1] / (time.perf_counter() - start)


@torch.no_grad()
def batch_step_speed(model: nn.Module, prompt: torch.Tensor, batch: int = 16, steps: int = 8) -> float:
    """Output tokens per second of decode steps of `batch` sequences together on the engine's forward (the step a
    server runs for `batch` clients), each sequence after a prefill of `prompt` [1, P], the KV cache in fp16 as
    `serve` keeps it; the median of `steps` timed steps after one untimed (kernels for the row count are chosen
    then)."""
    length = prompt.shape[1]
    max_tokens = length + steps + 1
    parts = DecoderParts(model, max_tokens)
    pool = sequence_pool(parts, batch, max_tokens, "float16")
    decoder = BatchDecoder(parts, pool)
    slots = [pool.allocate(max_tokens) for _ in range(batch)]
    last = torch.tensor([length - 1])
    tokens = torch.stack([decoder.forward(prompt[0], pool.rows([slot] * length, range(length)), last)[0].argmax()
                          for slot in slots])
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        logits = decoder.forward(tokens, pool.rows(slots, [length + step] * batch), torch.arange(batch))
        tokens = logits.argmax(-1)
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times[1:])


def latency_breakdown(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 16,
                      runtime: str = "transformers") -> dict[str, float]:
    """Seconds per decoded token in load / quant / gemm / other, from a profiled greedy decode after the prompt."""
    return profile_decode(model, prompt, new_tokens, runtime)["total"]


def profile_decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int = 16, runtime: str = "transformers") -> dict:
    """Profile `new_tokens - 1` greedy decode steps after the prompt (the prefill runs outside the profile).

    Returns {"total": {part: s per token}, "layers": {layer kind: {part: s per token}}}: parts load / quant / gemm
    / other; layer kinds are the quantized layers' names within their block (q_proj, or q_proj+k_proj+v_proj when
    fused; lm_head), each the sum over the blocks. CPU time is summed over threads, so every part is its share of
    the profiled CPU time applied to the wall time of a decode step."""
    from torch.profiler import ProfilerActivity, profile

    _name_layers(model)
    timed_greedy(model, prompt[:, :8], 4, runtime)  # warm up outside the profile
    run = Greedy(model, runtime, prompt.shape[1] + new_tokens)
    token = run.prefill(prompt)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = run.step(token)
        decode_s = time.perf_counter() - start
    totals = {"load": 0.0, "quant": 0.0, "gemm": 0.0}
    all_self = 0.0
    for event in prof.key_averages():
        all_self += event.self_cpu_time_total
        if event.key in GEMM_OPS:
            totals["gemm"] += event.self_cpu_time_total
        for part, scope in SCOPES.items():
            if event.key == scope:
                totals[part] += event.cpu_time_total
    gemm_in_scopes = _gemm_inside(prof, set(SCOPES.values()))
    for part, scope in SCOPES.items():
        totals[part] = max(0.0, totals[part] - gemm_in_scopes.get(scope, 0.0))
    totals["other"] = max(0.0, all_self - sum(totals.values()))
    # Profiled times are CPU time summed over threads; their shares split the wall time of a decode step.
    to_seconds = decode_s / (new_tokens - 1) / (sum(totals.values()) or 1.0)
    layers = {kind: {part: micros * to_seconds for part, micros in parts.items()}
              for kind, parts in _per_layer(prof).items()}
    return {"total": {part: micros * to_seconds for part, micros in totals.items()}, "layers": layers}


def _name_layers(model: nn.Module) -> None:
    """Give each quantized layer (and each fused group's GEMM) the name its profiler scope will carry."""
    from llmeasyquant.nn.qlinear import QuantLinear

    groups: dict[int, tuple[object, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.profile_name = name.rsplit(".", 1)[-1]
            if module.shared is not None:
                call = module.shared[0]
                groups.setdefault(id(call), (call, []))[1].append(module.profile_name)
    for call, names in groups.values():
        call.combined.profile_name = "+".join(names)


def _per_layer(prof: object) -> dict[str, dict[str, float]]:
    """Microseconds per layer kind and part, from the layer scopes QuantLinear opens while profiling."""
    found: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if not event.name.startswith(LAYER_SCOPE):
            continue
        parts = found.setdefault(event.name[len(LAYER_SCOPE):], {"load": 0.0, "quant": 0.0, "gemm": 0.0,
                                                                  "other": 0.0})
        inside = {"load": 0.0, "quant": 0.0, "gemm": 0.0}
        for child in _descendants(event):
            if child.name in GEMM_OPS:
                inside["gemm"] += child.self_cpu_time_total
            for part, scope in SCOPES.items():
                if child.name == scope:
                    inside[part] += child.cpu_time_total
        for part in ("load", "quant", "gemm"):
            parts[part] += inside[part]
        parts["other"] += max(0.0, event.cpu_time_total - sum(inside.values()))
    return found


def _gemm_inside(prof: object, scopes: set[str]) -> dict[str, float]:
    """Self time of GEMM operators that ran inside each named scope (microseconds), so no time counts twice."""
    inside: dict[str, float] = {}
    for event in prof.events():
        if event.name not in scopes:
            continue
        for child in _descendants(event):
            if child.name in GEMM_OPS:
                inside[event.name] = inside.get(event.name, 0.0) + child.self_cpu_time_total
    return inside


def _descendants(event: object) -> list:
    found, stack = [], list(event.cpu_children)
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(child.cpu_children)
    return found
