"""Block streaming, for models larger than memory: the model is built without weights, the tensors outside the
transformer blocks (embeddings, final norm, LM head) are read at once, and each block's tensors are read from the
folder's safetensors only when the sequential runner reaches that block. Once quantized, a block holds packed
integers, so the float weights of at most one block (two, while the next is read) are ever in memory.

With a sink (`hollow=True`, what `quantize --stream` uses), memory no longer grows with the model: the input
embeddings are mapped from the folder's file in their stored type (the lookup's output is cast, which is exact),
and mapped afresh once the calibration tokens are looked up, so the pages read then leave the process (1 GB at
8B); an untied LM head is not read (the writer copies it from the folder at the end); and every quantized block is
handed to the sink (the sharded checkpoint writer) and released to the meta device.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from llmeasyquant.errors import ModelLoadError
from llmeasyquant.infra.memory import release_freed_memory
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


_SAFETENSORS_TYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def mapped_tensor(file: Path, name: str) -> torch.Tensor | None:
    """Tensor `name` of a safetensors file as a private memory map (pages read only when touched; nothing is
    written back), or None where its type or alignment does not allow a view."""
    with file.open("rb") as handle:
        header_bytes = struct.unpack("<Q", handle.read(8))[0]
        entry = json.loads(handle.read(header_bytes))[name]
    dtype = _SAFETENSORS_TYPES.get(entry["dtype"])
    begin, end = (8 + header_bytes + offset for offset in entry["data_offsets"])
    if dtype is None or begin % dtype.itemsize:
        return None
    mapped = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
    return mapped[begin:end].view(dtype).view(entry["shape"])


BlockSink = Callable[[str, torch.nn.Module], None]  # (the block's name prefix, the quantized block) -> None


class BlockStreamer:
    """Reads one block's tensors into a model built on the meta device; counts the float blocks held. With a
    `sink`, each finished block is handed to it and then released to the meta device."""

    def __init__(self, model: PreTrainedModel, folder: Path, dtype: torch.dtype) -> None:
        self.model, self.folder, self.dtype = model, folder, dtype
        self.files = _tensor_files(folder)
        self.arch = arch_for(model)
        self.prefix = self.arch.blocks + "."
        self.max_float_blocks = 0  # the most blocks whose float linear weights were in memory at once
        self.sink: BlockSink | None = None
        self.embeddings_name: str | None = None  # set when they are memory-mapped (a hollow model)

    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor as the folder stores it (its own type), for a writer copying what was never loaded."""
        stored = stored_name(self.arch, name)
        if stored not in self.files:
            raise ModelLoadError(f"{self.folder} lacks the tensor {stored}; the folder does not match its config")
        with safe_open(str(self.files[stored]), "pt") as handle:
            return handle.get_tensor(stored)

    def load_module(self, name: str) -> None:
        """Read the tensors of a module outside the blocks that was left unread (a head the plan quantizes)."""
        self._read([n for n, p in self.model.named_parameters() if n.startswith(name + ".") and p.is_meta])

    def finish_block(self, index: int, block: torch.nn.Module) -> None:
        """Called by the runner once block `index` is quantized: with a sink, write it out and release it."""
        if self.sink is None:
            return
        self.sink(f"{self.prefix}{index}.", block)
        block.to("meta")  # its packed integers are on disk now; memory stays one block's worth
        release_freed_memory()
        log.debug("block %d written and released", index)

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
        self._check_outside()

    def load_all_but_head(self) -> None:
        """What runs before the first block and the final norm, without the LM head (left on the meta device for
        the writer to copy from the folder, unless tied to the embeddings). The input embeddings are memory-mapped in
        the folder's type (`map_embeddings`; a hook casts the lookup's output to the model's type, exactly)."""
        embeddings = self.model.get_input_embeddings()
        head = self.model.get_output_embeddings()
        outside = [(n, p) for n, p in self.model.named_parameters() if not n.startswith(self.prefix)]
        self.embeddings_name = next(n for n, p in outside if p is embeddings.weight)
        skip = {id(embeddings.weight)} | ({id(p) for p in head.parameters()} if head is not None else set())
        rest = [n for n, p in outside if id(p) not in skip and stored_name(self.arch, n) in self.files]
        self.map_embeddings()
        dtype = self.dtype
        embeddings.register_forward_hook(lambda _m, _i, out: out.to(dtype))
        self._read(rest)

    def map_embeddings(self) -> None:
        """Map the input embeddings from the folder afresh (a hollow model's; a no-op otherwise): the rows a lookup
        read leave the process's memory with the old map. The runner calls it once the calibration tokens are
        looked up; the file pages are read again only by the writer at the end."""
        name = self.embeddings_name
        if name is None:
            return
        stored = stored_name(self.arch, name)
        if stored not in self.files:
            raise ModelLoadError(f"{self.folder} lacks the tensor {stored}; the folder does not match its config")
        value = mapped_tensor(self.files[stored], stored)
        if value is None:  # a type or an offset that a view cannot take: held in memory instead
            value = self.read_tensor(name)
            value = value if value.dtype in (torch.float16, torch.bfloat16) else value.to(self.dtype)
        set_module_tensor_to_device(self.model, name, "cpu", value=value, dtype=value.dtype)
        self.model.tie_weights()

    def _check_outside(self) -> None:
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


def load_model_streamed(folder: str | Path, dtype: torch.dtype = torch.float32, hollow: bool = False
                        ) -> tuple[PreTrainedModel, object, BlockStreamer]:
    """A Hugging Face folder's model with only the tensors outside its blocks loaded, its tokenizer, and the
    streamer that `quantize(..., stream=streamer)` reads the blocks with. `hollow` leaves the LM head unread
    and the embeddings memory-mapped, for a run whose streamer gets a sink (the quantized model is then on disk)."""
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} is not a Hugging Face model folder (no config.json); streaming needs one")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers such as RoPE's inverse frequencies stay computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    streamer = BlockStreamer(model, folder, dtype)
    if hollow:
        streamer.load_all_but_head()
    else:
        streamer.load_outside_blocks()
    model.llmeasyquant_source = str(folder.resolve())
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True), streamer
