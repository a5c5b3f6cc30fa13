"""How long a comparison will take, said before it starts: each method timed on copies of the model cut to its first
one and two blocks (with the full calibration data, so the per-block cost is real; the difference of the two
removes what is paid once, such as preparing the calibration inputs), scaled to every block, plus the evaluation."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from llmeasyquant.api import quantize
from llmeasyquant.models.arch import arch_for, get_module, set_module
from llmeasyquant.models.streaming import BlockStreamer
from llmeasyquant.plan import Plan
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)

DETAILS_S_PER_WINDOW_S = 30.0  # `--details` costs about this many evaluation windows per row (speed, profile, ...)


def first_blocks_copy(model: nn.Module, count: int = 1, share_outside: bool = False) -> nn.Module:
    """A copy of `model` that keeps only its first `count` blocks (the rest of the model as it is). With
    `share_outside` the tensors outside the blocks are the model's own, not copies (for a run that leaves them
    unchanged: a streamed one, whose embeddings are the largest thing in memory)."""
    blocks_path = arch_for(model).blocks
    blocks = get_module(model, blocks_path)
    kept = blocks[:count]
    set_module(model, blocks_path, nn.ModuleList())  # so that the deep copy does not copy every block
    try:
        memo = {id(t): t for t in model.parameters()} if share_outside else {}
        small = copy.deepcopy(model, memo)
    finally:
        set_module(model, blocks_path, blocks)
    set_module(small, blocks_path, copy.deepcopy(kept))
    config = small.config.get_text_config()
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: len(kept)]
    return small


def _timed(model: nn.Module, recipe: list, scheme: QuantScheme | Plan, calib: torch.Tensor | None, count: int,
           stream: BlockStreamer | None) -> float:
    small = first_blocks_copy(model, count, share_outside=stream is not None)
    small_stream = None
    if stream is not None:  # the copy's blocks are read from the same folder, and released as in the real run
        small_stream = BlockStreamer(small, stream.folder, stream.dtype)
        small_stream.sink = lambda _prefix, _block: None
    start = time.perf_counter()
    quantize(small, copy.deepcopy(recipe), scheme, calib=calib, progress=False, stream=small_stream)
    return time.perf_counter() - start


def quantize_seconds(model: nn.Module, recipe: list, scheme: QuantScheme | Plan, calib: torch.Tensor | None,
                     stream: BlockStreamer | None = None) -> float:
    """Estimated seconds to quantize `model` with the recipe, from its first one and two blocks timed alone.
    `stream`: the model is a streamed one (blocks on the meta device), whose blocks the timing reads from its folder."""
    blocks = len(get_module(model, arch_for(model).blocks))
    one = _timed(model, recipe, scheme, calib, 1, stream)
    if blocks == 1:
        return one
    per_block = max(_timed(model, recipe, scheme, calib, 2, stream) - one, 0.0)
    return max(one - per_block, 0.0) + blocks * per_block if per_block > 0 else one * blocks


def log_estimate(model: nn.Module, rows: Sequence, calib_for: Callable, window_s: float, windows: int,
                 details: bool) -> dict[str, float]:
    """Time one block of each row's method, add the evaluation, and log the total before the real work starts.
    Returns the seconds expected per row's quantization (by row name), for the evaluation and in all ("total")."""
    parts = []
    for row in rows:
        try:
            parts.append((row.name, quantize_seconds(model, row.recipe, row.scheme, calib_for(row))))
        except Exception as exc:  # an estimate must never stop the run it estimates
            log.debug("no estimate for %s: %s", row.name, exc)
    evaluation = window_s * windows * (len(rows) + 1)
    extra = window_s * DETAILS_S_PER_WINDOW_S * (len(rows) + 1) if details else 0.0
    total = sum(s for _, s in parts) + evaluation + extra
    log.info("estimated time: about %.0f min (quantization %s; evaluation %.0f s%s), from one and two blocks per "
             "method and one window timed now", total / 60, ", ".join(f"{n} {s:.0f} s" for n, s in parts) or "unknown",
             evaluation, f"; speed and layer measurements {extra:.0f} s" if details else "")
    return dict(parts) | {"evaluation": evaluation, "details": extra, "total": total}
