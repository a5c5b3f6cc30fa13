"""The sharded checkpoint a streamed quantization writes block by block, so that the quantized model is never whole
in memory: each finished block's tensors go to a shard as soon as the block is done, and what lies outside the
blocks is written at the end, tensors never read from the source folder being copied from it one at a time.

The folder is our checkpoint format (export/checkpoint.py reads it): `model-0000k-of-0000n.safetensors` shards,
`model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map": {tensor: shard}}) and the usual
settings files. The caller writes into a temporary folder (infra/files.py's staged_folder) renamed when complete.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.export.checkpoint import FORMAT, INDEX_FILE, storable, write_settings
from llmeasyquant.infra.memory import release_freed_memory
from llmeasyquant.models.streaming import BlockStreamer

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 27  # a shard is written once this much is waiting: memory holds at most this plus one tensor
# (128 MiB: what waits adds to the peak of a streamed run, whose blocks are tens or hundreds of MB packed)
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
           torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory. safetensors' save_file first
    builds the whole file's bytes in memory, which doubles a shard's footprint at the moment memory is fullest."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for tensor in tensors.values():
            if tensor.numel():
                file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class ShardedWriter:
    """Collects tensors into shards of about `shard_bytes` in `folder` (a staging folder), then the index."""

    def __init__(self, folder: Path, float_dtype: torch.dtype, shard_bytes: int = SHARD_BYTES) -> None:
        self.folder, self.float_dtype, self.shard_bytes = Path(folder), float_dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.shards: list[list[str]] = []  # the tensor names of each shard written, in order
        self.total_bytes = 0

    def add_block(self, prefix: str, block: nn.Module) -> None:
        """A quantized block's tensors under their model names (the streamer's sink)."""
        tensors, aliases = storable(block.state_dict(prefix=prefix).items(), self.float_dtype)
        if aliases:  # a block sharing storage between its own tensors: nothing in the supported families does
            raise ConfigError(f"{prefix} ties {sorted(aliases)[:2]} inside a block; save without --stream")
        self._add(tensors)

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        write_safetensors(self.folder / self._part_name(len(self.shards)), self.pending,
                          {"format": "pt", "producer": FORMAT})
        self.total_bytes += sum(t.numel() * t.element_size() for t in self.pending.values())
        self.shards.append(list(self.pending))
        self.pending = {}
        release_freed_memory()

    @staticmethod
    def _part_name(index: int) -> str:
        return f".part-{index:05d}.safetensors"  # renamed once the number of shards is known

    def finish(self, model: nn.Module, stream: BlockStreamer, tokenizer: object | None) -> None:
        """Write what lies outside the blocks (tensors still on the meta device come from the source folder), the
        index and the settings files. The model's tensors outside the blocks are released as they are written:
        the model is left a shell (its quantization info and layer shapes), the checkpoint is the model."""
        self._flush()  # the blocks' shards first: what follows is the largest of the tensors
        blocks = stream.prefix
        entries = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if not n.startswith(blocks)]
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, tensor in entries:  # tied tensors are stored once, as storable does for a whole state dict
            if not tensor.is_meta:
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
                if key in seen:
                    aliases[name] = seen[key]
                seen.setdefault(key, name)
        names = [n for n, _ in entries]
        del entries, seen  # from here the model alone holds its tensors, so releasing them frees them
        for name in names:  # one at a time: cast, written, released
            if name in aliases:
                continue
            tensor = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
            value = stream.read_tensor(name) if tensor.is_meta else tensor.detach()  # meta: never read (a head)
            del tensor
            self._add(storable([(name, value)], self.float_dtype)[0])
            del value
            # The model is a shell once written (its info and layer shapes are what is used after): the embeddings
            # and whatever shares them go, before the next large tensor is read.
            for released in [name] + [alias for alias, kept in aliases.items() if kept == name]:
                set_module_tensor_to_device(model, released, "meta")
        self._flush()
        count, weight_map = len(self.shards), {}
        for index, names in enumerate(self.shards):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            (self.folder / self._part_name(index)).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
        write_settings(model, self.folder, aliases, tokenizer)
        log.info("wrote %d tensors in %d shards (%.2f GB)", len(weight_map), count, self.total_bytes / 1e9)

