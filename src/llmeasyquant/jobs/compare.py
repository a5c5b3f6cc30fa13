"""Compare schemes or methods against the unquantized model: quantize, save, reload and evaluate each row."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from llmeasyquant.api import default_scheme, quantize
from llmeasyquant.calibration.data import calibration_ids
from llmeasyquant.errors import ConfigError, DataError
from llmeasyquant.eval.details import details_protocol, measure_details
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows
from llmeasyquant.export.checkpoint import bits_per_weight, checkpoint_bytes, load, save
from llmeasyquant.jobs.estimate import log_estimate
from llmeasyquant.jobs.evaluate import prepare_windows
from llmeasyquant.methods import Method, recipe_by_name
from llmeasyquant.methods.simquant import SimQuant
from llmeasyquant.models.load import load_model
from llmeasyquant.nn.qlinear import quantized_layers
from llmeasyquant.record import Record
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)

UNIT_WINDOWS = 8  # the fp32 evaluation that quantization time is divided by ("units")


def float_bytes(model: nn.Module, bytes_per_value: int = 4) -> int:
    """Bytes of the model's weights stored as floats of the given width, tied tensors once."""
    seen = {p.data_ptr(): p.numel() for p in model.parameters()}
    return bytes_per_value * sum(seen.values())


def quantized_weight_ratio(model: nn.Module) -> float:
    """Stored bytes of the quantized layers over the bytes their fp32 weights took."""
    layers = quantized_layers(model).values()
    return sum(q.storage_bytes() for q in layers) / sum(4 * q.in_features * q.out_features for q in layers)


@dataclasses.dataclass(frozen=True)
class _Row:
    name: str  # the row's label: the scheme (one recipe, several schemes) or the method (several methods)
    method: str
    recipe: list
    scheme: QuantScheme


@dataclasses.dataclass(frozen=True)
class CompareSpec:
    """What `compare` measures: the rows, and the protocol every row is measured under.

    Rows: `recipe` under each of `schemes`, or, with `methods` (names such as 'gptq' or 'awq+gptq'), one per
    method under its own scheme (or the one scheme given), each taking the `method_options` it has. `kv` adds a
    quantized KV cache to every quantized row. `calib` ('wikitext2' for the shipped validation split, a file, or
    'self') feeds methods that need calibration (`calib_samples` sequences of `calib_seqlen` tokens); it may not be
    the evaluation text. Evaluation: `text` (None: the shipped WikiText-2 test) cut into at most `max_windows`
    windows of `seqlen` tokens. `keep_fp32` stores the unquantized tensors in fp32; `workdir` keeps the checkpoints
    (default: a temporary folder); `seed` seeds generated text and sampling. `details` also measures what the
    report's figures need (docs/compare_record.md): speed and latency breakdown, block errors, a weight histogram,
    per-layer summaries, perplexity over context length.
    """

    model: str = "smollm2-135m"
    schemes: Sequence[QuantScheme] = ()
    recipe: str | Method | Sequence[Method] = "rtn"
    _: dataclasses.KW_ONLY
    methods: Sequence[str] | None = None
    method_options: dict = dataclasses.field(default_factory=dict)
    kv: SimQuant | None = None
    text: str | None = None
    seqlen: int = 512
    max_windows: int | None = 40
    calib: str | None = None
    calib_samples: int = 64
    calib_seqlen: int = 512
    keep_fp32: bool = False
    workdir: str | Path | None = None
    seed: int = 0
    details: bool = False


def _rows(spec: CompareSpec) -> list[_Row]:
    """One row per method (each under its own scheme unless one scheme is given), else one per scheme."""
    extra = [spec.kv] if spec.kv is not None else []
    schemes = spec.schemes
    if spec.methods:
        if len(schemes) > 1:
            raise ConfigError("with several methods give at most one scheme (or none: each method's own)")
        rows = []
        for name in spec.methods:
            chosen = recipe_by_name(name, strict=False, **(spec.method_options or {}))
            scheme = schemes[0] if schemes else default_scheme(chosen)
            rows.append(_Row(f"{name} {scheme.name}", "+".join(m.name for m in chosen), chosen + extra, scheme))
        return rows
    chosen = recipe_by_name(spec.recipe) if isinstance(spec.recipe, str) else spec.recipe
    chosen = list(chosen) if isinstance(chosen, Sequence) else [chosen]
    method = "+".join(m.name for m in chosen)
    return [_Row(scheme.name, method, chosen + extra, scheme) for scheme in schemes]


def _needs_calibration(row: _Row) -> bool:
    return any(getattr(m, "needs_calibration", False) for m in row.recipe) or row.scheme.static_act


def compare(spec: CompareSpec, progress: bool = True, command: str | None = None) -> list[Record]:
    """Quantize the model once per row of `spec`, save and reload each checkpoint, and evaluate all of them side by
    side against the unquantized model on the same windows. Returns one record per row, fp32 first.

    `progress` shows progress bars and logs an estimate of the duration first; `command` is the command line the
    records name (default: this process's)."""
    rows = _rows(spec)
    kv, calib, seed = spec.kv, spec.calib, spec.seed
    if not rows:
        raise ConfigError("nothing to compare: name at least one scheme or method")
    start = time.perf_counter()
    torch.manual_seed(seed)
    base, tokenizer = load_model(spec.model)
    windows = prepare_windows(base, tokenizer, spec.text, spec.seqlen, spec.max_windows, seed)
    calib_ids, calib_protocol = None, {}
    if any(_needs_calibration(r) for r in rows) or (kv is not None and calib is not None):
        if calib is None:
            what = next((r.method for r in rows if _needs_calibration(r)), "the KV cache")
            raise ConfigError(f"{what} needs calibration text: pass calib='wikitext2' (shipped WikiText-2 "
                              "validation), a file path, or 'self'")
        calib_ids, source = calibration_ids(calib, base, tokenizer, spec.calib_samples, spec.calib_seqlen, seed)
        if source.sha256 == windows.protocol["text_sha256"]:
            raise DataError("the calibration text is the evaluation text; calibrate on another split")
        calib_protocol = {"calib_source": source.description, "calib_sha256": source.sha256,
                          "calib_samples": int(calib_ids.shape[0]), "calib_seqlen": spec.calib_seqlen}
    unit_windows = EvalWindows(windows.ids[:UNIT_WINDOWS], windows.protocol)
    unit_s = evaluate_windows({"fp32": base}, unit_windows, progress=False)["fp32"]["eval_s"]
    # The estimate is for the person waiting; without progress output nobody reads it, so it is not made.
    estimate = log_estimate(base, rows, lambda row: calib_ids if _needs_calibration(row) else None,
                            unit_s / UNIT_WINDOWS, windows.ids.shape[0], spec.details) if progress else {}
    with tempfile.TemporaryDirectory(prefix="llmeasyquant-compare-") as scratch:
        root = Path(spec.workdir) if spec.workdir is not None else Path(scratch)
        candidates: dict[str, nn.Module] = {}
        extra: dict[str, dict] = {}
        for index, row in enumerate(rows, 1):
            log.info("[%d/%d] quantizing with %s %s", index, len(rows), row.method, row.scheme.name)
            calibrated = _needs_calibration(row) or (kv is not None and calib_ids is not None)
            model = quantize(copy.deepcopy(base), row.recipe, row.scheme, calib=calib_ids if calibrated else None,
                             keep_fp32=spec.keep_fp32, progress=progress)
            folder = save(model, root / row.name.replace(" ", "_"), tokenizer, force=True)
            quantize_s = model.llmeasyquant.quantize_s
            del model
            # Evaluate what the checkpoint holds, not what was left in memory.
            candidates[row.name], _ = load(folder)
            extra[row.name] = {
                "method": row.method, "scheme": row.scheme.name, "quantize_s": quantize_s,
                "quantize_units": quantize_s / unit_s, "checkpoint_bytes": checkpoint_bytes(folder),
                "bits_per_weight": bits_per_weight(candidates[row.name]),
                "weight_bytes_ratio": quantized_weight_ratio(candidates[row.name]),
                "calib_samples": int(calib_ids.shape[0]) if _needs_calibration(row) else 0,
                "quantize_estimate_s": estimate.get(row.name)}
        caches = {name: (lambda m=m: m.llmeasyquant.kv_cache.new_cache(m)) for name, m in candidates.items()
                  if m.llmeasyquant.kv_cache is not None}
        metrics = evaluate_windows({"fp32": base, **candidates}, windows, reference="fp32", progress=progress,
                                   caches=caches)
        extra["fp32"] = {"method": "fp32", "scheme": "fp32", "bits_per_weight": 32.0,
                         "checkpoint_bytes": float_bytes(base), "quantize_s": 0.0, "calib_samples": 0}
        if spec.details:
            for name, model in tqdm({"fp32": base, **candidates}.items(), desc="measuring speed and layers",
                                    unit="row", disable=not progress):
                extra[name] |= measure_details(base, model, windows)
    timing = {"unit_eval_s": unit_s, "wall_s": time.perf_counter() - start, "estimated_s": estimate.get("total")}
    return _records(spec, rows, metrics, extra, windows, timing, calib_protocol, command)


def _records(spec: CompareSpec, rows: list[_Row], metrics: dict, extra: dict, windows: EvalWindows, timing: dict,
             calib_protocol: dict, command: str | None) -> list[Record]:
    base_ppl = metrics["fp32"]["ppl"]
    by_name = {row.name: row for row in rows}
    records = []
    for name in ["fp32", *by_name]:
        row = metrics[name] | extra[name]
        row["ppl_delta_pct"] = 100 * (row["ppl"] / base_ppl - 1)
        row["checkpoint_mb"] = row["checkpoint_bytes"] / 2**20
        row["weight_bytes_pct"] = 100 * row.get("weight_bytes_ratio", 1.0)
        row["top1_pct"] = 100 * row["top1"] if not math.isnan(row.get("top1", math.nan)) else None
        protocol = windows.protocol | timing | (details_protocol() if spec.details else {})
        if name != "fp32":
            protocol |= {"recipe": [{"method": m.name, **dataclasses.asdict(m)} for m in by_name[name].recipe],
                         **calib_protocol}
            if spec.kv is not None:
                row["kv_cache"] = spec.kv.config.name
        records.append(Record.new("compare", spec.model, row, protocol, command))
    return records
