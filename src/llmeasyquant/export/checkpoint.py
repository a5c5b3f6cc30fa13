"""Our checkpoint: safetensors + config.json + quantization_config.json (+ tokenizer files).

Written to a temporary folder beside the target and renamed when complete; an existing folder is replaced only
with `force=True`. Loading never unpickles: tensors come from safetensors, settings from JSON. The tensors are one
`model.safetensors` (`save`) or shards `model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json`
(`export/sharded.py`, what a streamed quantization writes); `load` reads either, building the model on the meta
device and filling it from the files, so the float model is never made in memory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmeasyquant.errors import CheckpointError, ConfigError
from llmeasyquant.infra.files import check_output, staged_folder
from llmeasyquant.models.arch import arch_for, get_module, is_linear, linear_weight, set_module
from llmeasyquant.models.experts import unfuse_experts
from llmeasyquant.nn.kv.cache import KVCacheSpec
from llmeasyquant.nn.kv.calibration import KeyRanges
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.nn.positions import track_positions
from llmeasyquant.nn.qlinear import FULL_PRECISION_STATE, QuantLinear, quantized_layers
from llmeasyquant.nn.transform import HadamardTransform, attach_input_transform
from llmeasyquant.scheme import QuantScheme

log = logging.getLogger(__name__)

FORMAT = "llmeasyquant"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's {"weight_map": {tensor: shard file}}
KV_FILE = "kv_cache.safetensors"  # calibrated key ranges of the quantized KV cache, when there are some
QCONFIG_FILE = "quantization_config.json"


def stored_tensors(model: nn.Module, float_dtype: torch.dtype) -> tuple[dict, dict[str, str]]:
    """State dict with tied tensors stored once ({dropped name: kept name}) and float tensors cast for storage."""
    return storable(model.state_dict().items(), float_dtype)


def storable(items: Iterable[tuple[str, torch.Tensor]], float_dtype: torch.dtype) -> tuple[dict, dict[str, str]]:
    """(name, tensor) pairs as `stored_tensors` stores them: tied ones once, float ones cast for storage."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in items:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        if (tensor.is_floating_point() and tensor.dtype not in (torch.float16, float_dtype)
                and not name.endswith(FULL_PRECISION_STATE)):
            cast = tensor.to(float_dtype)
            # A tensor that overflows the storage type stays as it is (quantize() kept it in fp32 on purpose).
            if _all_finite(cast) or not _all_finite(tensor):
                tensor = cast
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view into a larger buffer (fused layers): safetensors stores whole tensors
        tensors[name] = tensor.detach().contiguous()
    return tensors, aliases


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """torch.isfinite(t).all(), a chunk at a time: on a whole 128k x 4k embedding the check's temporaries are
    larger than the tensor."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


def save(model: nn.Module, out_dir: str | Path, tokenizer: object | None = None, force: bool = False) -> Path:
    """Write a quantized model (from `quantize`) as a checkpoint folder; returns its path."""
    info = getattr(model, "llmeasyquant", None)
    layers = quantized_layers(model)
    if info is None or not layers:
        raise ConfigError("this model is not quantized; run llmeasyquant.quantize() on it before saving")
    out = Path(out_dir).expanduser()
    check_output(out, force)
    tensors, aliases = stored_tensors(model, storage_dtype(model))
    with staged_folder(out, force) as tmp:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt", "producer": FORMAT})
        write_settings(model, tmp, aliases, tokenizer)
    log.info("saved %d quantized layers to %s", len(layers), out)
    return out


def storage_dtype(model: nn.Module) -> torch.dtype:
    """The type the tensors left float are stored in, as `quantize(keep_fp32=...)` chose."""
    return torch.float16 if model.llmeasyquant.float_dtype == "float16" else torch.float32


def write_settings(model: nn.Module, folder: Path, aliases: dict[str, str], tokenizer: object | None) -> None:
    """Everything but the model's tensors: quantization_config.json, config.json, the KV cache's ranges and the
    tokenizer (shared by the one-file and the sharded writer)."""
    info = model.llmeasyquant
    layers = quantized_layers(model)
    qconfig = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "float_dtype": info.float_dtype,
        "source_model": info.source, "recipe": info.recipe, "plan": info.plan, "tied": aliases,
        "layers": {name: layer.scheme.to_dict() for name, layer in layers.items()},
    }
    transforms = {name: layer.input_transform.describe() for name, layer in layers.items()
                  if layer.input_transform is not None}
    if info.calibration:  # a mixture of experts: tokens per expert layer, and the fallbacks of those that had few
        qconfig["calibration"] = info.calibration
    if transforms:  # rotate's online Hadamard: its shape here, its signs and odd part in the tensors
        qconfig["input_transforms"] = transforms
    kv = info.kv_cache
    if kv is not None:
        qconfig["kv_cache"] = {"config": kv.config.to_dict(), "calibrated": kv.key_ranges is not None}
        if kv.key_ranges is not None:
            save_file(kv.key_ranges.to_tensors(), folder / KV_FILE, metadata={"format": "pt", "producer": FORMAT})
    (folder / "config.json").write_text(model.config.to_json_string())
    (folder / QCONFIG_FILE).write_text(json.dumps(qconfig, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _read_qconfig(path: Path) -> dict:
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}; check the path")
    qfile = path / QCONFIG_FILE
    if not qfile.is_file():
        raise CheckpointError(f"{path} has no {QCONFIG_FILE}; it is not an llmeasyquant checkpoint")
    try:
        qconfig = json.loads(qfile.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{qfile} is corrupt (not valid JSON: {exc}); re-create the checkpoint") from exc
    if qconfig.get("format") != FORMAT or qconfig.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{qfile} is not format {FORMAT} v{FORMAT_VERSION}; re-create the checkpoint")
    return qconfig


def _weight_files(path: Path) -> list[str]:
    """The files holding the model's tensors: the shards the index lists, or the one file."""
    index = path / INDEX_FILE
    if not index.is_file():
        return [WEIGHTS_FILE]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is corrupt ({exc}); re-create the checkpoint") from exc


def _read_tensors(path: Path, name: str = WEIGHTS_FILE) -> dict[str, torch.Tensor]:
    wfile = path / name
    if not wfile.is_file():
        raise CheckpointError(f"{path} has no {name}; the checkpoint is incomplete")
    try:
        return load_file(wfile)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{wfile} is corrupt ({exc}); re-create the checkpoint") from exc


def _compatible(stored: torch.Tensor, wanted: torch.Tensor) -> bool:
    """Same shape, and the same integer type (float tensors may be stored in another float width)."""
    if stored.shape != wanted.shape or stored.is_floating_point() != wanted.is_floating_point():
        return False
    return stored.is_floating_point() or stored.dtype == wanted.dtype


def _check_match(model: nn.Module, tensors: dict[str, torch.Tensor], tied: dict[str, str], path: Path) -> None:
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k} {tensors[k].dtype}{tuple(tensors[k].shape)} != {v.dtype}{tuple(v.shape)}"
             for k, v in expected.items() if k in tensors and not _compatible(tensors[k], v)]
    if missing or unexpected or wrong:
        details = "; ".join(filter(None, [
            f"missing {missing[:3]}" if missing else "", f"unexpected {unexpected[:3]}" if unexpected else "",
            f"mismatched {wrong[:3]}" if wrong else ""]))
        raise CheckpointError(f"{path} does not match its configuration ({details}); re-create the checkpoint")


def load(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object | None]:
    """Rebuild a quantized model from a checkpoint folder; returns (model, tokenizer or None)."""
    path = Path(path).expanduser()
    qconfig = _read_qconfig(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        schemes = {name: QuantScheme.from_dict(s) for name, s in qconfig["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has an unreadable configuration ({exc}); re-create the checkpoint") from exc
    # On the meta device: the float weights the quantized layers replace are never allocated. Buffers computed at
    # construction (RoPE's inverse frequencies) stay real.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unfuse_experts(model)  # quantize() split the experts into per-expert linears: so are the stored layers
    for name, scheme in schemes.items():
        try:
            module = get_module(model, name)
        except AttributeError as exc:
            raise CheckpointError(f"{path} names layer {name!r}, which this model does not have") from exc
        if not is_linear(module):
            raise CheckpointError(f"{path} names layer {name!r}, which is not a linear layer of this model")
        out_features, in_features = linear_weight(module).shape
        has_bias = getattr(module, "bias", None) is not None
        set_module(model, name, QuantLinear(in_features, out_features, scheme, has_bias, dtype))
    _add_input_transforms(model, qconfig.get("input_transforms", {}), path)
    track_positions(model, arch_for(model).blocks, schemes.values())
    shards = [_read_tensors(path, file) for file in _weight_files(path)]  # mapped, not yet read
    tied = qconfig.get("tied", {})
    _check_match(model, {name: t for shard in shards for name, t in shard.items()}, tied, path)
    expected = {k: v.dtype for k, v in model.state_dict().items()}
    # One tensor at a time, each file tensor dropped once in place, a shard's mapping let go once it is all read.
    for shard in shards:
        for name in list(shard):
            stored = value = shard.pop(name)
            if value.is_floating_point() and not name.endswith(FULL_PRECISION_STATE):
                value = value.to(dtype)
            # The type the module holds (a scale stays fp16): what copying into a preallocated tensor would give.
            value = value.to(expected[name])
            if value is stored:
                # Still the file's mapped pages. Decoding streams every weight every token, and on the 8B W4A16
                # shape it ran about 3% faster from the process's own copies (RESULTS.md, "Speed at real sizes").
                value = value.clone()
            model.load_state_dict({name: value}, strict=False, assign=True)
    for alias, kept in tied.items():  # tie the same way the saved model was tied
        parent, _, leaf = alias.rpartition(".")
        kept_parent, _, kept_leaf = kept.rpartition(".")
        setattr(get_module(model, parent), leaf, getattr(get_module(model, kept_parent), kept_leaf))
    unread = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if unread:
        raise CheckpointError(f"{path} does not fill {unread[:3]}; re-create the checkpoint")
    model.eval()
    model.llmeasyquant_source = qconfig.get("source_model")
    from llmeasyquant.api import QuantizationInfo

    model.llmeasyquant = QuantizationInfo(recipe=qconfig.get("recipe", []), plan=qconfig.get("plan", {}),
                                          float_dtype=qconfig["float_dtype"], source=qconfig.get("source_model"),
                                          calibration=qconfig.get("calibration", {}),
                                          kv_cache=_read_kv_cache(path, qconfig,
                                                                  config.get_text_config().num_hidden_layers))
    tokenizer = None
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _add_input_transforms(model: nn.Module, entries: dict, path: Path) -> None:
    """Give each layer the checkpoint lists an online input transform of the recorded shape; the state dict then
    fills its values."""
    for name, entry in entries.items():
        try:
            layer = get_module(model, name)
            if not isinstance(layer, QuantLinear) or entry["kind"] != "hadamard":
                raise ValueError(f"{entry.get('kind')!r} on {type(layer).__name__}")
            transform = HadamardTransform.empty(int(entry["width"]), int(entry["odd"]))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path} has an unreadable input transform for {name!r} ({exc}); re-create the "
                                  "checkpoint") from exc
        if transform.width != layer.in_features:
            raise CheckpointError(f"{path}: the input transform of {name!r} has width {transform.width}, the layer "
                                  f"{layer.in_features} inputs; re-create the checkpoint")
        attach_input_transform(layer, transform)


def _read_kv_cache(path: Path, qconfig: dict, layers: int) -> KVCacheSpec | None:
    entry = qconfig.get("kv_cache")
    if entry is None:
        return None
    try:
        config = KVQuantConfig.from_dict(entry["config"])
        ranges = KeyRanges.from_tensors(_read_tensors(path, KV_FILE)) if entry["calibrated"] else None
    except (ConfigError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} has an unreadable KV-cache section ({exc}); re-create the checkpoint") from exc
    if ranges is not None and len(ranges.lo) != layers:
        raise CheckpointError(f"{path}/{KV_FILE} holds key ranges for {len(ranges.lo)} layers but the model has "
                              f"{layers}; re-create the checkpoint")
    return KVCacheSpec(config, ranges)


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path).expanduser() / QCONFIG_FILE).is_file()


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes on disk of every file in the checkpoint folder."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits (codes, scales, zero points) per quantized weight, over all quantized layers."""
    layers = quantized_layers(model).values()
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    return 8 * sum(layer.storage_bytes() for layer in layers) / weights if weights else float("nan")
