"""Synthetic checkpoints: real model shapes with random weights, to test the toolkit at real sizes.

    python benchmarks/make_synthetic.py --shape llama-3.2-1b --out DIR [--seed 0] [--layers N]
        [--shard-gb 2] [--force] [--check]

Writes a Hugging Face folder: config.json (the real architecture's values; see SHAPES), bf16 safetensors shards
(model-0000X-of-0000N.safetensors) with model.safetensors.index.json, and the bundled SmolLM2 tokenizer. Each
tensor is drawn from its own generator, seeded from (seed, tensor name): the same seed gives byte-identical files
whatever the sharding. Tensors are drawn and written chunk by chunk, so memory stays far below the checkpoint's
size (the 8B is 16 GB). The folder is written beside DIR under a temporary name and renamed when complete.
`--check` then loads it with transformers and prints each block's hidden-state size and the logits' spread.
The shapes, the initialisation and the measured times are in docs/RESULTS.md, 'Synthetic checkpoints at real sizes'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch
from tqdm import tqdm

CHUNK_ELEMENTS = 1 << 24  # elements drawn at once (64 MB in float32); the draws depend on it: do not change
SHARD_GB = 2.0  # shards of at most this many GB (10**9 bytes): the 1B gets two, the 8B eight

LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B's config.json (bos/eos replaced by the shipped tokenizer's)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_3_8B = {  # meta-llama/Meta-Llama-3-8B's config.json (bos/eos replaced by the shipped tokenizer's)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN3_MOE_MINI = {  # Qwen3-30B-A3B's config.json, sizes cut down (128 experts top-8 -> 32 top-4, 48 -> 8 layers)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 8,
    "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 8, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
MIXTRAL_MINI = {  # Mixtral-8x7B's config.json with the sizes cut down (4096 -> 1024 wide, 32 -> 8 layers); its vocab
    # (32000) is smaller than the shipped tokenizer's, so the tokenizer's 49152 is used
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 2816, "max_position_embeddings": 32768,
    "num_attention_heads": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8, "num_key_value_heads": 2,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 49152,
}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 49152}  # the tokenizer's vocabulary: the smallest that it can index
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3-8b": LLAMA_3_8B,
    "qwen3-moe-mini": QWEN3_MOE_MINI,
    "mixtral-mini": MIXTRAL_MINI,
    # test sizes: the same architectures (tied llama3 rope, fused experts) a few MB large
    "llama-tiny": {**LLAMA_3_2_1B, **TINY, "intermediate_size": 160},
    "qwen3-moe-tiny": {**QWEN3_MOE_MINI, **TINY, "intermediate_size": 96, "moe_intermediate_size": 32,
                       "num_experts": 4, "num_experts_per_tok": 2, "max_window_layers": 2},
    "mixtral-tiny": {**MIXTRAL_MINI, **TINY, "intermediate_size": 96, "num_local_experts": 4},
}
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "w2.weight")  # write into the residual stream


def shape_config(shape: str, layers: int | None = None) -> dict:
    """The config.json of a shape, with `layers` blocks when given."""
    config = json.loads(json.dumps(SHAPES[shape]))  # a deep copy
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = layers
    return config


def _order(name: str) -> tuple[bool, list[int | str]]:
    """The order of the model: embeddings, the blocks (layers.2 before layers.10), final norm, LM head last."""
    return name.startswith("lm_head"), [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each tensor a checkpoint of this config holds, as transformers writes it.

    The model is built on the meta device (no memory); transformers 5 fuses MoE experts into 3-D parameters and
    splits them back into per-expert tensors when saving (the names of the hub's checkpoints), so the names come
    from the same reversal that save_pretrained applies. Tied weights appear once.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names = revert_weight_conversion(model, dict(model.named_parameters()))
    return sorted(((name, tuple(t.shape)) for name, t in names.items()), key=lambda item: _order(item[0]))


def tensor_init(name: str, shape: tuple[int, ...], config: dict) -> tuple[str, float]:
    """('fill', value) or ('normal', std) for one tensor: scaled so that every block's activations stay O(1).

    Projections: std 1/sqrt(fan_in), which keeps a unit-size input at unit size; those writing into the residual
    stream are further scaled by 1/sqrt(2 * layers), so the 2 * layers contributions sum to O(1). Untied embeddings:
    std 1 (the residual stream starts at unit size); the untied head 1/sqrt(hidden) (unit-size logits). Tied
    embeddings serve both ends: std hidden**-1/4, the geometric mean (logits of size hidden**1/4, ~7 for the 1B).
    Norms 1, biases 0.
    """
    hidden = config["hidden_size"]
    if name.endswith("norm.weight"):
        return "fill", 1.0
    if name.endswith(".bias"):
        return "fill", 0.0
    if len(shape) != 2:
        raise ValueError(f"no initialisation rule for {name} of shape {shape}; add one to tensor_init")
    if name.endswith("embed_tokens.weight"):
        return "normal", hidden ** -0.25 if config.get("tie_word_embeddings") else 1.0
    if name == "lm_head.weight":
        return "normal", hidden ** -0.5
    std = shape[1] ** -0.5
    if name.endswith(OUTPUT_PROJECTIONS):
        std /= math.sqrt(2 * config["num_hidden_layers"])
    return "normal", std


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name): each tensor's draws are independent of every other tensor."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def tensor_chunks(name: str, shape: tuple[int, ...], config: dict, seed: int) -> Iterator[torch.Tensor]:
    """The tensor's bf16 values, flat, in chunks of whole rows of at most CHUNK_ELEMENTS."""
    kind, value = tensor_init(name, shape, config)
    numel = math.prod(shape)
    if kind == "fill":
        yield torch.full((numel,), value, dtype=torch.bfloat16)
        return
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    step = max(1, CHUNK_ELEMENTS // shape[-1]) * shape[-1]
    for start in range(0, numel, step):
        draw = torch.empty(min(step, numel - start), dtype=torch.float32).normal_(0.0, value, generator=generator)
        yield draw.to(torch.bfloat16)


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], max_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in order, a new shard whenever the next one would take the current shard past max_bytes."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _header(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The safetensors header: 8-byte little-endian length, then JSON padded with blanks to 8-byte alignment."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        end = offset + 2 * math.prod(shape)
        entries[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], config: dict, seed: int,
                progress: tqdm) -> None:
    """One safetensors file, written tensor by tensor and chunk by chunk (no tensor is ever whole in memory)."""
    with open(path, "wb") as handle:
        handle.write(_header(tensors))
        for name, shape in tensors:
            for chunk in tensor_chunks(name, shape, config, seed):
                handle.write(chunk.view(torch.int16).numpy().data)  # bf16 bits, little-endian like safetensors
                progress.update(2 * chunk.numel())


@cache
def bundled_tokenizer() -> object:
    """SmolLM2-135M-Instruct's tokenizer, read from the bundled GGUF (49152 tokens)."""
    from transformers import AutoTokenizer

    from llmeasyquant.models.load import bundled_gguf

    gguf = bundled_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def generate(shape: str, out: Path, seed: int = 0, layers: int | None = None, shard_gb: float = SHARD_GB,
             force: bool = False) -> Path:
    """Write the folder `out`; refuses an existing one unless `force` (then replaced only once the new is complete)."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    config = shape_config(shape, layers)
    tokenizer = bundled_tokenizer()
    if len(tokenizer) > config["vocab_size"]:
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens do not fit {shape}'s vocab_size")
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    specs = tensor_specs(config)
    total = sum(2 * math.prod(s) for _, s in specs)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + (50 << 20):
        raise OSError(f"{out.parent} has {free / 1e9:.1f} GB free; {shape} needs {total / 1e9:.1f} GB")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        shards = plan_shards(specs, int(shard_gb * 1e9))
        weight_map = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=shape) as progress:
            for number, tensors in enumerate(shards, 1):
                file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                write_shard(partial / file, tensors, config, seed, progress)
                weight_map.update(dict.fromkeys((name for name, _ in tensors), file))
        index = {"metadata": {"total_size": total, "total_parameters": total // 2}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def check(folder: Path, text: str = "The quick brown fox jumps over the lazy dog. " * 4) -> dict:
    """Load `folder` with transformers (bf16, as stored) and run one forward: each block's hidden-state size."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model(ids, output_hidden_states=True)
    rms = [h.float().pow(2).mean().sqrt().item() for h in output.hidden_states]
    logits = output.logits.float()
    return {"tokens": ids.shape[1], "hidden_rms": rms,
            "finite": all(torch.isfinite(h).all().item() for h in output.hidden_states)
            and bool(torch.isfinite(logits).all()),
            "logits_std": logits.std(dim=-1).mean().item(),
            "distinct_top1": len(set(logits.argmax(-1).flatten().tolist()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="number of blocks instead of the shape's own")
    parser.add_argument("--shard-gb", type=float, default=SHARD_GB, help=f"largest shard (default {SHARD_GB} GB)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--check", action="store_true", help="then load it and run one forward pass")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists; pass --force to replace it")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    generate(args.shape, args.out, args.seed, args.layers, args.shard_gb, args.force)
    print(f"wrote {args.out}")
    if args.check:
        stats = check(args.out)
        print(json.dumps(stats, indent=1))
        if not stats["finite"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
