"""Block streaming, for models larger than memory: the model is built without weights, the tensors outside the
transformer blocks (embeddings, final norm, LM head) are read at once, and each block's tensors are read from the
folder's safetensors only when the sequential runner reaches that block. Once quantized, a block holds packed
integers, so the float weights of at most one block (two, while the next is read) are ever in memory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from llmeasyquant.errors import ModelLoadError
from llmeasyquant.models.arch import arch_for, blocks_of, is_linear, stored_name

log = logging.getLogger(__name__)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or shards with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{folder} has no model.safetensors (or index); streaming reads safetensors only")
    with safe_open(str(single), "pt") as handle:
        return dict.fromkeys(handle.keys(), single)


class BlockStreamer:
    """Reads one block's tensors into a model built on the meta device; counts the float blocks held."""

    def __init__(self, model: PreTrainedModel, folder: Path, dtype: torch.dtype) -> None:
        self.model, self.folder, self.dtype = model, folder, dtype
        self.files = _tensor_files(folder)
        self.arch = arch_for(model)
        self.prefix = self.arch.blocks + "."
        self.max_float_blocks = 0  # the most blocks whose float linear weights were in memory at once

    def _read(self, names: list[str]) -> None:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if stored_name(self.arch, name) not in self.files:
                raise ModelLoadError(f"{self.folder} lacks the tensor {name}; the folder does not match its config")
            by_file.setdefault(self.files[stored_name(self.arch, name)], []).append(name)
        for file, wanted in by_file.items():
            with safe_open(str(file), "pt") as handle:
                for name in wanted:
                    tensor = handle.get_tensor(stored_name(self.arch, name)).to(self.dtype)
                    set_module_tensor_to_device(self.model, name, "cpu", value=tensor)

    def load_outside_blocks(self) -> None:
        """Embeddings, final norm and LM head (tied to the embeddings when the config says so)."""
        names = [n for n, _ in self.model.named_parameters() if not n.startswith(self.prefix)]
        self._read([n for n in names if stored_name(self.arch, n) in self.files])
        self.model.tie_weights()
        missing = [n for n, p in self.model.named_parameters() if p.is_meta and not n.startswith(self.prefix)]
        if missing:
            raise ModelLoadError(f"{self.folder} lacks {missing[:3]}; the folder does not match its config")

    def load_block(self, index: int) -> None:
        """Read block `index`'s tensors (the runner calls this just before it quantizes the block)."""
        prefix = f"{self.prefix}{index}."
        self._read([n for n, p in self.model.named_parameters() if n.startswith(prefix) and p.is_meta])
        self.max_float_blocks = max(self.max_float_blocks, self.float_blocks())
        log.debug("streamed block %d; %d blocks hold float weights", index, self.float_blocks())

    def float_blocks(self) -> int:
        """Blocks holding at least one float linear weight in memory."""
        return sum(any(is_linear(m) and not m.weight.is_meta for m in block.modules())
                   for block in blocks_of(self.model))


def load_model_streamed(folder: str | Path, dtype: torch.dtype = torch.float32
                        ) -> tuple[PreTrainedModel, object, BlockStreamer]:
    """A Hugging Face folder's model with only the tensors outside its blocks loaded, its tokenizer, and the
    streamer that `quantize(..., stream=streamer)` reads the blocks with."""
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder (no config.json); streaming needs one")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers such as RoPE's inverse frequencies stay computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    streamer = BlockStreamer(model, folder, dtype)
    streamer.load_outside_blocks()
    model.llmeasyquant_source = str(folder.resolve())
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True), streamer
