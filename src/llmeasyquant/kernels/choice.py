"""Which kernel runs a layer at a given number of rows: measured once per shape, not guessed.

No kernel is fastest everywhere. On the reference CPU, PyTorch's int8 weight-only operator beats everything at
one to sixteen rows (decode), while at 128 rows and more (prefill, evaluation) dequantizing the weight and running
the fp32 GEMM is 1.5-2.3x faster than it. So for each (device, scheme, layer shape, row bucket, threads) the
candidates are timed once, on this layer with random inputs, and the fastest is kept for the process.

Candidates: the device's kernels that support the layer, and for weight-only layers the reference kernel, which
for them is a plain dequantize-then-GEMM in fp32 (so where it wins, the result is the oracle's exactly). Layers
with quantized activations have no float candidate: their reference sums integer products in float64, an oracle,
never fast.

Every CPU kernel runs inside the engine's native step (each has a `step_call`: runtime/native_step.py), so the
timings judge the kernels on the path that runs; none is credited for a path of its own. For one row (a single
sequence's decode step) that path is the team (one parallel region for the step) where every linear has a team
form, so there the candidates are the kernels with one where any has (`on_the_step_path`).

`LLMEASYQUANT_KERNEL_CHOICE=first` turns the measurement off: the first supporting kernel in the registry's order,
for every row count (reproducible across machines; the tests use it).

Inside `pinned()` (calibration) nothing is measured either: a quantized block's outputs feed the next block's
statistics, so which kernel won a timing race in this process must not change the codes of the next block (nor
differ between one process and the ranks of a distributed run). The registry then picks the reference for a
weight-only layer (dequantize, fp32 GEMM: the oracle, and the fastest at calibration's hundreds of rows) and the
first supporting kernel otherwise (integer kernels with activations give the reference's bits by construction).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 16, 128, 512)  # rows timed for each bucket; a call uses the smallest bucket at least its rows
MODES = ("measured", "first")
Timer = Callable[[Any, Any, torch.Tensor], float]
_CHOSEN: dict[tuple, str] = {}
_PINNED = [0]  # how many `pinned()` blocks are open (nested ones allowed)


def row_bucket(rows: int) -> int:
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return ROW_BUCKETS[-1]


def mode() -> str:
    chosen = os.environ.get("LLMEASYQUANT_KERNEL_CHOICE", "measured") or "measured"
    if chosen not in MODES:
        from llmeasyquant.errors import ConfigError

        raise ConfigError(f"LLMEASYQUANT_KERNEL_CHOICE={chosen!r} is not one of {', '.join(MODES)}")
    return chosen


def _seconds(layer, kernel, x: torch.Tensor, repeats: int = 3) -> float:
    """Median seconds of `kernel` on `layer` for input x, after one warm-up call (which also prepares it)."""
    prepared = layer.prepared_for(kernel)
    kernel.run(layer, x, prepared)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.run(layer, x, prepared)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Inside: the kernel for a layer is fixed, not measured (see the module's docstring)."""
    _PINNED[0] += 1
    try:
        yield
    finally:
        _PINNED[0] -= 1


def is_pinned() -> bool:
    return _PINNED[0] > 0


def choose(layer, candidates: list[Any], rows: int, timer: Timer | None = None) -> Any:
    """The fastest of `candidates` for `layer` at `rows` rows, measured on first use of the key and cached."""
    if len(candidates) == 1:
        return candidates[0]
    bucket = row_bucket(rows)
    key = (layer.qweight.device.type, layer.scheme, layer.in_features, layer.out_features, bucket,
           tuple(k.name for k in candidates), torch.get_num_threads())
    if key not in _CHOSEN:
        timer = timer or _seconds
        x = torch.randn(bucket, layer.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            times = {k.name: timer(layer, k, x.to(layer.qweight.device)) for k in candidates}
        _CHOSEN[key] = min(times, key=times.get)
        log.info("kernel for %s %dx%d at %d rows: %s (%s)", layer.scheme.name, layer.in_features,
                 layer.out_features, bucket, _CHOSEN[key],
                 ", ".join(f"{name} {1e3 * s:.3f} ms" for name, s in times.items()))
    chosen = _CHOSEN[key]
    return next(k for k in candidates if k.name == chosen)


def on_the_step_path(layer, found: list[Any], rows: int) -> list[Any]:
    """The kernels of `found` to time for `rows` rows: for one row (a single sequence's decode step) those whose
    step form the native step's team runs, where any has one, else all. The team runs a step's blocks in one OpenMP
    parallel region only where every linear has such a form; one kernel without takes the whole step out of it,
    which timing a layer alone cannot see (SmolLM2-135M, batch 1: W8A8 5.6 ms a step in the team against 7.8
    without, W4A16 g32 5.6 against 6.2). At 2-16 rows the team bought nothing measurable (W8A8 37.6 ms either way
    at 16) and kernels without a team form were much faster (W4A16 g32 at 16 rows: 30 ms of native blocks on the
    timed choice, 55 on team kernels only), so there every kernel is timed (docs/RESULTS.md, "One decode path")."""
    from llmeasyquant.kernels import native

    ops = native.ops()
    bucket = row_bucket(rows)
    if ops is None or bucket != ROW_BUCKETS[0] or layer.qweight.device.type != "cpu":
        return found
    team = []
    for kernel in found:
        call = kernel.step_call(layer, layer.prepared_for(kernel), bucket)
        if call is not None and ops.has_team_form(*call.arguments(layer, ops.STEP_KINDS)):
            team.append(kernel)
    return team or found


def forget_choices() -> None:
    """Measure again on next use (after the machine or its load changed)."""
    _CHOSEN.clear()
