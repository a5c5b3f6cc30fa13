"""bench: speed and memory of a model against its float baseline, measured in one process, interleaved.

Protocol: batch 1, a `prompt_tokens` prompt (default 128), `new_tokens` greedy tokens (default 64);
prefill also at `prefill_tokens` (default 512). Each repeat times every model in turn, so a machine that slows
down mid-run slows all of them alike; the median of the repeats is reported, and speed-ups are ratios to the
baseline from the same repeats. Beside the speeds: the bytes of weights each decoded token reads, the machine's
measured read bandwidth (same threads), and the decode speed that bandwidth allows (bandwidth ÷ bytes per token).
"""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from llmeasyquant.eval.speed import (
    RUNTIMES,
    batch_step_speed,
    generation_speed,
    prefill_speed,
    profile_decode,
    resolve_runtime,
)
from llmeasyquant.infra.memory import huge_page_buffer
from llmeasyquant.kernels import native
from llmeasyquant.nn.qlinear import QuantLinear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    prompt_tokens: int = 128
    new_tokens: int = 64
    prefill_tokens: int = 512
    repeats: int = 3
    threads: tuple[int, ...] = ()  # () = torch's current setting only
    breakdown: bool = True
    runtime: str = "auto"  # for every model but the baseline, which runs on transformers (eval/speed.py RUNTIMES)
    batch: int = 16  # sequences of the batched decode step timed on the engine's forward (0: not timed)

    def __post_init__(self) -> None:
        if self.batch < 0:
            raise ValueError(f"batch must be 0 (not timed) or more, got {self.batch}")
        for name in ("prompt_tokens", "prefill_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be at least 2 to time a decode step, got {self.new_tokens}")
        if any(t < 1 for t in self.threads):
            raise ValueError(f"thread counts must be at least 1, got {list(self.threads)}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}")


def memory_bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Read bandwidth in GB/s with torch's current threads: the best of `repeats` reads of a buffer far larger than
    the caches, each read two ways where the fused operators build: summing it, and the operators' streaming read
    (a few sequential streams a thread, each prefetched ahead, as the decode kernels read their weights). A decode
    step streams its weights the same way: read once, nothing written. The second exists because on some CPUs a
    sum reads slower than the kernels do (on the 2-core Xeon of docs/RESULTS.md 21 GB/s against 29), and a bound
    below what is reached bounds nothing. For the same reason the buffer is read on 4 KiB pages and, where the
    system has them, on 2 MiB pages too, as the decoding commands place the weights (nn/placement.py)."""
    numel = megabytes * 2**20 // 4
    buffers = [torch.ones(numel)]
    huge = huge_page_buffer(numel * 4)
    if huge is not None:
        buffers.append(huge.view(torch.float32).fill_(1.0))
    ops = native.ops()
    reads = [read for buffer in buffers for read in
             [buffer.sum] + ([lambda b=buffer: ops.stream_xor(b.view(torch.uint8))] if ops is not None else [])]
    best = float("inf")
    for _ in range(repeats):
        for read in reads:
            start = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - start)
    return numel * 4 / best / 1e9


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of parameters and buffers a decode step reads: every tensor once, except embedding tables, of which
    one row is looked up (unless the LM head shares the table: then the head reads it whole)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for tensor in [*model.parameters(), *model.buffers()]:
        # A tensor is known by where it starts and its size, not by its storage: fused layers' buffers are row
        # views into one storage (nn/fused.py), each read once.
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key in seen:
            continue
        seen.add(key)
        if id(tensor) in looked_up and tensor is not head_weight:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def model_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor the model holds in memory."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def _timed_round(models: dict[str, nn.Module], runtimes: dict[str, str], prompt: torch.Tensor,
                 long_prompt: torch.Tensor, config: BenchConfig) -> dict[str, dict[str, float]]:
    """One interleaved round: every model's prefill (both lengths) and decode speed."""
    found = {}
    for name, model in models.items():
        speed = generation_speed(model, prompt[:, : config.prompt_tokens], config.new_tokens, runtime=runtimes[name])
        speed["prefill_long_tok_s"] = prefill_speed(model, long_prompt, runtimes[name])
        if config.batch and runtimes[name] == "lean":  # the engine's step over a batch of sequences
            speed["batch_tok_s"] = batch_step_speed(model, prompt[:, : config.prompt_tokens], config.batch)
        found[name] = speed
    return found


def bench(models: dict[str, nn.Module], prompt: torch.Tensor, config: BenchConfig, baseline: str | None = None,
          progress: bool = True, runtimes: dict[str, str] | None = None) -> list[dict]:
    """Rows (one per model and thread count) of speeds, speed-ups against `baseline`, bytes and the breakdown.

    `prompt` [1, ≥ max(prompt_tokens, prefill_tokens)] token ids. Each model runs on `runtimes[name]` where given,
    else the baseline on transformers and the others on `config.runtime`."""
    runtimes = {name: resolve_runtime(model, (runtimes or {}).get(
        name, "transformers" if name == baseline else config.runtime)) for name, model in models.items()}
    needed = max(config.prompt_tokens, config.prefill_tokens)
    if prompt.shape[-1] < needed:
        raise ValueError(f"the prompt has {prompt.shape[-1]} tokens; bench needs {needed}")
    if baseline is not None and baseline not in models:
        raise ValueError(f"baseline {baseline!r} is not among the models {list(models)}")
    long_prompt = prompt[:, : config.prefill_tokens]
    before = torch.get_num_threads()
    rows = []
    try:
        for threads in config.threads or (before,):
            torch.set_num_threads(threads)
            bandwidth = memory_bandwidth_gbs()
            rounds = [_timed_round(models, runtimes, prompt, long_prompt, config)
                      for _ in tqdm(range(config.repeats), desc=f"bench rounds, {threads} threads", unit="round",
                                    disable=not progress)]
            rows += _rows(models, runtimes, rounds, threads, bandwidth, baseline, prompt, config)
    finally:
        torch.set_num_threads(before)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for row in rows:
        row["peak_rss_mb"] = peak  # of the whole process (every model was loaded in it)
    return rows


def _rows(models: dict[str, nn.Module], runtimes: dict[str, str], rounds: list[dict], threads: int,
          bandwidth: float, baseline: str | None, prompt: torch.Tensor, config: BenchConfig) -> list[dict]:
    keys = ("prefill_tok_s", "prefill_long_tok_s", "decode_tok_s", "batch_tok_s")
    medians = {name: {k: statistics.median(r[name][k] for r in rounds) for k in keys if k in rounds[0][name]}
               for name in models}
    rows = []
    for name, model in models.items():
        per_token = weight_bytes_per_token(model)
        row = {"model": name, "runtime": runtimes[name], "threads": threads, **medians[name],
               "decode_ms_per_token": 1000 / medians[name]["decode_tok_s"],
               "decode_tok_s_runs": [r[name]["decode_tok_s"] for r in rounds],
               "weight_bytes_per_token": per_token, "model_mb": model_bytes(model) / 2**20,
               "bandwidth_gbs": bandwidth, "bandwidth_bound_tok_s": bandwidth * 1e9 / per_token,
               "config": asdict(config)}
        if baseline is not None:
            base = medians[baseline]
            row["prefill_speedup"] = row["prefill_tok_s"] / base["prefill_tok_s"]
            row["prefill_long_speedup"] = row["prefill_long_tok_s"] / base["prefill_long_tok_s"]
            row["decode_speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
            # a quantized model that loses to the float one somewhere (the float model on our runtime is not flagged)
            quantized = any(isinstance(m, QuantLinear) for m in model.modules())
            row["slower_than_baseline"] = [key for key in SPEEDUPS if quantized and row[key] < 1.0]
        if config.breakdown:
            profiled = profile_decode(model, prompt[:, : config.prompt_tokens], runtime=runtimes[name])
            row["latency"] = profiled["total"]
            row["latency_ms_per_token"] = {part: 1000 * s for part, s in profiled["total"].items()}
            row["latency_layers_ms_per_token"] = {kind: {part: 1000 * s for part, s in parts.items()}
                                                  for kind, parts in profiled["layers"].items()}
        rows.append(row)
    return rows


def thread_counts(text: str | None) -> tuple[int, ...]:
    """'1,2' -> (1, 2); None -> ()."""
    if text is None:
        return ()
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"thread counts must be integers separated by commas, e.g. 1,2; got {text!r}") from exc
    if not counts:
        raise ValueError("no thread count given; write e.g. 1,2")
    return counts


SPEEDUPS = ("prefill_speedup", "prefill_long_speedup", "decode_speedup")


def summary_lines(rows: Sequence[dict]) -> list[str]:
    """A plain-text table of the rows, for the terminal, and a line for each quantized model that is slower than
    the unquantized baseline anywhere: on some CPUs (no AVX-512, no bf16 or int8 dot products) a scheme's kernels can
    lose to the fp32 GEMM they replace."""
    width = max([5, *(len(r["model"]) for r in rows)])
    head = (f"{'model':{width}s} {'thr':>3s} {'prefill tok/s':>13s} {'×':>5s} {'prefill-long':>12s} {'×':>5s} "
            f"{'decode tok/s':>12s} {'×':>5s} {'batch tok/s':>11s} {'MB/token':>8s} {'bound':>6s}  "
            "ms/token load/quant/gemm/other")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r.get("latency_ms_per_token")
        parts = " / ".join(f"{ms[k]:.1f}" for k in ("load", "quant", "gemm", "other")) if ms else "-"
        lines.append(f"{r['model']:{width}s} {r['threads']:3d} {r['prefill_tok_s']:13.1f} "
                     f"{r.get('prefill_speedup', float('nan')):5.2f} {r['prefill_long_tok_s']:12.1f} "
                     f"{r.get('prefill_long_speedup', float('nan')):5.2f} {r['decode_tok_s']:12.1f} "
                     f"{r.get('decode_speedup', float('nan')):5.2f} {r.get('batch_tok_s', float('nan')):11.1f} "
                     f"{r['weight_bytes_per_token'] / 1e6:8.1f} "
                     f"{r['bandwidth_bound_tok_s']:6.0f}  {parts}")
    for r in rows:
        if r.get("slower_than_baseline"):
            slower = ", ".join(f"{key.removesuffix('_speedup').replace('_', '-')} {r[key]:.2f}x"
                               for key in r["slower_than_baseline"])
            lines.append(f"SLOWER THAN THE UNQUANTIZED MODEL: {r['model']} ({slower}) on this CPU "
                         f"({torch.backends.cpu.get_cpu_capability()} kernels)")
    return lines


def layer_lines(rows: Sequence[dict]) -> list[str]:
    """Per quantized layer kind, ms per decoded token by part, for each row that was profiled."""
    lines = []
    for r in rows:
        layers = r.get("latency_layers_ms_per_token")
        if not layers:
            continue
        width = max(len(kind) for kind in layers)
        lines += ["", f"{r['model']}, {r['threads']} threads: ms per decoded token, summed over the blocks",
                  f"{'layer':{width}s} {'load':>6s} {'quant':>6s} {'gemm':>6s} {'other':>6s} {'total':>6s}"]
        for kind, parts in sorted(layers.items(), key=lambda item: -sum(item[1].values())):
            lines.append(f"{kind:{width}s} " + " ".join(f"{parts[k]:6.2f}" for k in ("load", "quant", "gemm", "other"))
                         + f" {sum(parts.values()):6.2f}")
    return lines
