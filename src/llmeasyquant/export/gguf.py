"""GGUF export for llama.cpp: our integer codes repacked into Q8_0 / Q4_0 / Q4_1 blocks, and a llama.cpp runtime.

What GGUF needs to know about a model family (its architecture name, tensor names, whether q/k rows are permuted)
is the `gguf` entry of its architecture (models/arch.py). How codes become blocks: `gguf_blocks.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as QType
from torch import nn

from llmeasyquant.errors import CheckpointError, ConfigError
from llmeasyquant.export.common import ExportResult, RuntimeLogits, Stopwatch, layers_to_export, require
from llmeasyquant.export.gguf_blocks import Packed, pack_layer
from llmeasyquant.infra.files import check_output, write_atomic
from llmeasyquant.models.arch import ARCHITECTURES, ArchSpec, get_module
from llmeasyquant.models.load import BUNDLED_NAMES, bundled_gguf
from llmeasyquant.nn.qlinear import QuantLinear
from llmeasyquant.primitives import QParams

log = logging.getLogger(__name__)

# GGUF metadata: key -> (value, type, element type of an array or None).
Meta = dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]
_U32, _F32, _STR, _ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_theta(config: Any) -> float:
    # transformers 5 keeps it in rope_parameters, older versions as rope_theta.
    theta = getattr(config, "rope_theta", None)
    return float(theta if theta is not None else (getattr(config, "rope_parameters", None) or {}).get("rope_theta"))


def _kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# (key under the architecture's prefix, type, how to read it from the HF config): llama.cpp's hyperparameters.
_HPARAMS: tuple[tuple[str, GGUFValueType, Callable[[Any], Any]], ...] = (
    ("context_length", _U32, lambda c: c.max_position_embeddings),
    ("embedding_length", _U32, lambda c: c.hidden_size),
    ("block_count", _U32, lambda c: c.num_hidden_layers),
    ("feed_forward_length", _U32, lambda c: c.intermediate_size),
    ("attention.head_count", _U32, lambda c: c.num_attention_heads),
    ("attention.head_count_kv", _U32, _kv_heads),
    ("attention.key_length", _U32, _head_dim),
    ("attention.value_length", _U32, _head_dim),
    ("rope.dimension_count", _U32, _head_dim),
    ("rope.freq_base", _F32, _rope_theta),
    ("attention.layer_norm_rms_epsilon", _F32, lambda c: c.rms_norm_eps),
    ("vocab_size", _U32, lambda c: c.vocab_size),
)
_FILE_TYPES = {QType.Q8_0: LlamaFileType.MOSTLY_Q8_0, QType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
               QType.Q4_1: LlamaFileType.MOSTLY_Q4_1, QType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
               QType.F16: LlamaFileType.MOSTLY_F16}
# Keys of a source GGUF that describe its tensors or file, not the model: never copied.
_FILE_KEYS = ("GGUF.", "split.", "general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment")


def gguf_arch(model: nn.Module) -> ArchSpec:
    """The model's architecture entry, which must have a `gguf` map."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None or arch.gguf is None:
        supported = sorted(name for name, entry in ARCHITECTURES.items() if entry.gguf is not None)
        raise ConfigError(f"GGUF export does not support the model family {model_type!r}; supported: "
                          f"{', '.join(supported)}. Add a `gguf` entry to llmeasyquant/models/arch.py:ARCHITECTURES")
    return arch


def _permuted(arch: ArchSpec) -> dict[str, Callable[[Any], int]]:
    """Block module -> its head count, for the projections whose rows llama.cpp's interleaved rope needs permuted."""
    if not arch.gguf.permute_qk:
        return {}
    return {arch.attention.q: lambda c: c.num_attention_heads, arch.attention.k: _kv_heads}


# tensors -----------------------------------------------------------------------------------------------------


@dataclass
class _Tensors:
    """What will be written (GGUF name -> array and type) and how each quantized layer fared."""

    arrays: dict[str, tuple[np.ndarray, QType]] = field(default_factory=dict)
    lossless: list[str] = field(default_factory=list)
    requantized: list[str] = field(default_factory=list)
    as_f16: list[str] = field(default_factory=list)  # rows too short for any block type
    m_rounded: int = 0
    requantized_grids: list[str] = field(default_factory=list)  # grid layers re-rounded to IQ4_NL
    consumed: set[str] = field(default_factory=set)  # state-dict keys accounted for


def _qk_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order taking HF's rotate-half layout to llama.cpp's interleaved pairs: in each head, GGUF row 2 * d + t
    is HF row t * half + d (the inverse of transformers' reverse_permute when it loads a GGUF)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, 2, half).transpose(1, 2).reshape(-1)


def _quantized(layer: QuantLinear, rows: torch.Tensor | None) -> Packed:
    # Rows move with their scales and zeros, so a row permutation keeps per-row groups exact.
    codes, qp = layer.codes().cpu(), layer.qparams()
    scale, zero = qp.scale.cpu(), None if qp.zero is None else qp.zero.cpu()
    levels = None if qp.levels is None else qp.levels.cpu()
    if rows is not None:
        codes, scale, zero = codes[rows], scale[rows], None if zero is None else zero[rows]
        levels = levels if levels is None or levels.shape[0] == 1 else levels[rows]
    return pack_layer(codes, QParams(scale, zero, qp.group_size, levels), layer.scheme.bits, layer.scheme.symmetric,
                      layer.scheme.grid)


def _float(tensor: torch.Tensor, rows: torch.Tensor | None, matrix_type: QType) -> tuple[np.ndarray, QType]:
    """Norms, biases and embeddings: F32 vectors, matrices in `matrix_type` (F16, or F32 for a model kept fp32)."""
    tensor = tensor.detach().float().cpu()
    if rows is not None:
        tensor = tensor[rows]
    if tensor.dim() == 2 and matrix_type == QType.F16:
        return tensor.numpy().astype(np.float16), QType.F16
    return tensor.numpy(), QType.F32


def _add_module(found: _Tensors, name: str, path: str, module: nn.Module, rows: torch.Tensor | None,
                matrix_type: QType) -> None:
    found.consumed.update(f"{path}.{key}" for key in module.state_dict())
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, QuantLinear):
        packed = _quantized(module, rows)
        found.arrays[f"{name}.weight"] = (packed.data, packed.qtype)
        ledger = found.lossless if packed.exact else found.as_f16 if packed.qtype == QType.F16 else found.requantized
        ledger.append(path)
        if packed.qtype == QType.IQ4_NL and not packed.exact:
            found.requantized_grids.append(path)
        found.m_rounded += packed.m_rounded
        params = {"bias": module.bias} if module.bias is not None else {}
    for key, tensor in params.items():
        found.arrays[f"{name}.{key}"] = _float(tensor, rows, matrix_type)


def _is_tied(model: nn.Module, arch: ArchSpec) -> bool:
    """The LM head shares the embedding matrix (llama.cpp then uses the embedding's tensor for the output)."""
    weight = getattr(get_module(model, arch.lm_head), "weight", None)
    embed = get_module(model, arch.embeddings[0]).weight
    return bool(getattr(model.config, "tie_word_embeddings", False) and weight is not None
                and weight.data_ptr() == embed.data_ptr())


def _entries(model: nn.Module, arch: ArchSpec) -> list[tuple[str, str, Callable[[Any], int] | None]]:
    """(GGUF name, module path, head count for a q/k row permutation or None) for every module the table names."""
    spec, permute, blocks = arch.gguf, _permuted(arch), arch.blocks
    entries = [(gguf_name, path, None) for path, gguf_name in spec.top.items()]
    for i in range(len(get_module(model, blocks))):
        entries += [(f"blk.{i}.{g}", f"{blocks}.{i}.{p}", permute.get(p)) for p, g in spec.block.items()]
    return entries


def _collect(model: nn.Module, arch: ArchSpec, matrix_type: QType) -> _Tensors:
    found = _Tensors()
    tied, head = _is_tied(model, arch), arch.lm_head
    for gguf_name, path, heads in _entries(model, arch):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # an optional module this model does not have
        if path == head and tied:
            found.consumed.add(f"{head}.weight")
            continue
        rows = None
        if heads is not None:
            out_features = module.out_features if hasattr(module, "out_features") else module.weight.shape[0]
            rows = _qk_rows(out_features, heads(model.config))
        _add_module(found, gguf_name, path, module, rows, matrix_type)
    missing = sorted(set(model.state_dict()) - found.consumed)
    if missing:
        raise ConfigError(f"GGUF export has no tensor name for {', '.join(missing[:6])}"
                          f"{' ...' if len(missing) > 6 else ''}; add them to the family's `gguf` entry in "
                          "llmeasyquant/models/arch.py:ARCHITECTURES")
    return found


def _file_type(found: _Tensors, arch: ArchSpec) -> int:
    """general.file_type: the block type holding most quantized weights (not the float embedding and LM head)."""
    kept_float = {arch.gguf.top[arch.embeddings[0]], arch.gguf.top[arch.lm_head]}
    counts: dict[QType, int] = {}
    for name, (array, qtype) in found.arrays.items():
        if qtype != QType.F32 and name.rpartition(".")[0] not in kept_float:
            counts[qtype] = counts.get(qtype, 0) + array.size
    return int(_FILE_TYPES.get(max(counts, key=counts.get), LlamaFileType.MOSTLY_F16)) if counts else 0


# metadata ----------------------------------------------------------------------------------------------------


def _source_gguf(model: nn.Module) -> Path | None:
    """The GGUF file the model was loaded from, when it was one (its tokenizer and metadata are reused)."""
    info = getattr(model, "llmeasyquant", None)
    source = getattr(info, "source", None) or getattr(model, "llmeasyquant_source", None)
    if not source:
        return None
    if source.lower() in BUNDLED_NAMES:
        return bundled_gguf()
    path = Path(source).expanduser()
    if source.lower().endswith(".gguf"):
        if path.is_file():
            return path
        log.warning("the model's source %s is gone; GGUF metadata is rebuilt from the config", path)
    return None


def _config_metadata(model: nn.Module, name: str) -> Meta:
    config = model.config
    meta: Meta = {}
    for key, vtype, read in _HPARAMS:
        value = read(config)
        meta[f"{name}.{key}"] = (float(value) if vtype == _F32 else int(value), vtype, None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        log.warning("rope scaling %r is not written to the GGUF file; llama.cpp runs it as plain rope",
                    rope["rope_type"])
    return meta


def _copied_metadata(path: Path, arch: str) -> Meta:
    """Every key of a source GGUF except those describing its tensors and file: general.*, hparams, tokenizer.*."""
    reader = GGUFReader(path)
    source_arch = reader.fields["general.architecture"].contents()
    meta: Meta = {}
    for key, value in reader.fields.items():
        other_arch = source_arch != arch and key.startswith(f"{source_arch}.")
        nested = value.types[0] == _ARR and len(value.types) != 2
        if key.startswith(_FILE_KEYS) or other_arch or nested:
            continue
        meta[key] = (value.contents(), value.types[0], value.types[1] if len(value.types) > 1 else None)
    return meta


def _hf_tokenizer_metadata(tokenizer: Any, vocab_size: int, notes: list[str]) -> Meta:
    """A Hugging Face fast BPE tokenizer as llama.cpp's "gpt2" tokenizer; ConfigError says why it cannot be."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError("it is not a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    if spec["model"].get("type") != "BPE":
        raise ConfigError(f"its model is {spec['model'].get('type')}, not BPE")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ConfigError(f"it has ids up to {max(vocab.values())}, beyond the model's {vocab_size} embeddings")
    added = tokenizer.added_tokens_decoder
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]  # rows of the embedding no token uses
    types = [int(TokenType.UNUSED)] * vocab_size
    for token, i in vocab.items():
        kind = TokenType.NORMAL if i not in added else TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED
        tokens[i], types[i] = token, int(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    meta: Meta = {"tokenizer.ggml.model": ("gpt2", _STR, None), "tokenizer.ggml.pre": ("default", _STR, None),
                  "tokenizer.ggml.tokens": (tokens, _ARR, _STR),
                  "tokenizer.ggml.token_type": (types, _ARR, GGUFValueType.INT32)}
    if merges:
        meta["tokenizer.ggml.merges"] = (merges, _ARR, _STR)
    for role in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            key = {"unk": "unknown", "pad": "padding"}.get(role, role)
            meta[f"tokenizer.ggml.{key}_token_id"] = (int(token_id), _U32, None)
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and tokenizer("a").input_ids[:1] == [bos]
    meta["tokenizer.ggml.add_bos_token"] = (adds_bos, GGUFValueType.BOOL, None)
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        meta["tokenizer.chat_template"] = (tokenizer.chat_template, _STR, None)
    notes.append("tokenizer written as llama.cpp's gpt2 BPE with the default pre-tokenizer: text may split "
                 "differently from the Hugging Face tokenizer (token ids given directly are unaffected)")
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        notes.append("the tokenizer is not byte-level BPE: llama.cpp's own tokenization of text will differ")
    return meta


def _metadata(model: nn.Module, name: str, tokenizer: Any, notes: list[str]) -> Meta:
    """The model's config gives the hyperparameters; a source GGUF gives everything else (tokenizer included)."""
    meta = _config_metadata(model, name)
    source = _source_gguf(model)
    if source is not None:
        copied = _copied_metadata(source, name)
        differ = sorted(k for k in meta if k in copied and copied[k][0] != meta[k][0])
        if differ:
            log.warning("the model's config differs from its source %s in %s; the config's values are written",
                        source, ", ".join(differ))
        notes.append(f"metadata and tokenizer copied from {source}")
        return {**copied, **meta}
    meta["general.name"] = (Path(str(getattr(model, "llmeasyquant_source", None) or name)).name, _STR, None)
    if tokenizer is None:
        reason = "no tokenizer was given"
    else:
        try:
            return {**meta, **_hf_tokenizer_metadata(tokenizer, model.config.vocab_size, notes)}
        except ConfigError as exc:
            reason = f"the tokenizer cannot be converted: {exc}"
    log.warning("GGUF file written without tokenizer metadata (%s); llama.cpp needs one to load it", reason)
    notes.append(f"no tokenizer metadata: {reason}")
    return meta


# export ------------------------------------------------------------------------------------------------------


def _write(path: Path, arch: str, meta: Meta, arrays: dict[str, tuple[np.ndarray, QType]]) -> None:
    writer = GGUFWriter(path, arch)
    for key, (value, vtype, sub_type) in meta.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, (array, qtype) in arrays.items():
        writer.add_tensor(name, array, raw_dtype=qtype if array.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _report(found: _Tensors, notes: list[str]) -> None:
    if found.requantized:
        log.warning("%d layer(s) have no exact GGUF block type (only groups of a multiple of 32, symmetric 8-bit or "
                    "2-4-bit, or the iq4nl grid, are exact) and were re-quantized by llama.cpp's rounding (IQ4_NL, "
                    "for nf4 and learned grids: by our iq4nl rounding): %s",
                    len(found.requantized), ", ".join(found.requantized))
    if found.requantized_grids:
        notes.append(f"{len(found.requantized_grids)} layer(s) on a non-uniform grid other than iq4nl (or in groups "
                     "not a multiple of 32) re-quantized to IQ4_NL blocks of 32 by our iq4nl rounding: "
                     + ", ".join(found.requantized_grids))
    if found.as_f16:
        log.warning("%d layer(s) have rows whose length is not a multiple of 32, which no GGUF block type holds; "
                    "written as F16: %s", len(found.as_f16), ", ".join(found.as_f16))
    if found.m_rounded:
        notes.append(f"Q4_1: {found.m_rounded} block offset(s) m = -(zero + 8) * scale rounded to fp16")


def export_gguf(model: nn.Module, tokenizer: object | None, out: str | Path, force: bool = False) -> ExportResult:
    """Write a quantized llama-family model as one GGUF file llama.cpp runs (atomically; `force` replaces `out`).

    Layers whose codes fit Q8_0 / Q4_0 / Q4_1 are repacked exactly; the rest are re-quantized (listed in the
    result's `requantized`). Embeddings and the LM head stay float (F16, or F32 when the model kept fp32)."""
    watch = Stopwatch()
    out = Path(out).expanduser()
    check_output(out, force)
    if out.is_dir():
        raise ConfigError(f"{out} is a folder; a GGUF export is one file: give a path ending in .gguf")
    arch = gguf_arch(model)
    quantized = layers_to_export(model, "GGUF")
    if any(layer.scheme.act is not None for layer in quantized.values()):
        notes = ["activation quantization is not stored: llama.cpp quantizes activations its own way"]
    else:
        notes = []
    keep_fp32 = getattr(getattr(model, "llmeasyquant", None), "float_dtype", "float16") == "float32"
    found = _collect(model, arch, QType.F32 if keep_fp32 else QType.F16)
    meta = _metadata(model, arch.gguf.name, tokenizer, notes)
    meta["general.file_type"] = (_file_type(found, arch), _U32, None)
    meta["general.quantization_version"] = (GGML_QUANT_VERSION, _U32, None)
    _report(found, notes)
    write_atomic(out, lambda tmp: _write(tmp, arch.gguf.name, meta, found.arrays))
    log.info("wrote %s: %d layers exact, %d re-quantized", out, len(found.lossless),
             len(found.requantized) + len(found.as_f16))
    return ExportResult(path=out, format="gguf", seconds=watch.seconds(), lossless=found.lossless,
                        requantized=found.requantized + found.as_f16, notes=notes)


# runtime -----------------------------------------------------------------------------------------------------


def open_gguf_runtime(path: str | Path, n_ctx: int, threads: int | None = None) -> RuntimeLogits:
    """Load a GGUF file in llama.cpp (llama-cpp-python); the result maps token ids [seqlen] to logits [seqlen, V]."""
    llama_cpp = require("llama_cpp", "pip install llama-cpp-python")
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist; export one with llmeasyquant export --to gguf")
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=threads, verbose=False)
    except ValueError as exc:  # llama-cpp-python's way of saying llama.cpp refused the file
        raise CheckpointError(f"llama.cpp cannot load {path}: {exc}; run it with verbose=True to see why") from exc

    def logits(ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 1 or len(ids) > n_ctx:
            raise ConfigError(f"expected token ids [seqlen <= {n_ctx}], got shape {tuple(ids.shape)}; "
                              "pass one sequence, or open the runtime with a larger n_ctx")
        llm.reset()  # a fresh sequence: no cached tokens from the last call
        llm.eval(ids.tolist())
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    return logits
