"""Architecture knowledge as data: one table entry per model family, keyed by `config.model_type`.

Methods never ask what class a module is; they read these entries. Module paths are dotted, relative to the
model (`blocks`, `lm_head`, ...) or to one block (attention projections, smoothing pairs). The rotary convention the
`rotary_embedding` entries share (rotate-half) is here too: `rotate_half`, `apply_rope`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear
from transformers.pytorch_utils import Conv1D

from llmeasyquant.errors import ConfigError


@dataclass(frozen=True)
class AttentionSpec:
    """Where queries, keys, values and the output projection live in a block (`qkv` when fused). `qkv_layout` says
    how a fused projection's output columns are ordered: "concat" is all query heads, then the key heads, then the
    value heads (GPT-2, Phi-3, Falcon's multi-query); "per_head" is, head by head, that head's query, key and value
    side by side (GPT-NeoX's query_key_value, one key/value head per query head)."""

    q: str | None
    k: str | None
    v: str | None
    o: str
    qkv: str | None = None
    qkv_layout: str = "concat"


@dataclass(frozen=True)
class DecoderSpec:
    """What the lean decode loop (runtime/decoder.py) needs of a pre-norm block with rotary attention and a gated
    MLP, as paths relative to one block. `qk_norm` names per-head RMSNorms applied to queries and keys before
    rotation (Qwen3), None where the family has none."""

    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attention: str = "self_attn"  # the module whose `head_dim` and `scaling` the loop reads
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    activation: str = "mlp.act_fn"
    qk_norm: tuple[str, str] | None = None
    # A fused gate-then-up projection (Phi-3's gate_up_proj), read instead of `gate` and `up` when set; a fused
    # q/k/v comes from the family's AttentionSpec (`qkv`, "concat" layout only).
    gate_up: str | None = None


@dataclass(frozen=True)
class GGUFSpec:
    """How llama.cpp stores the family (export/gguf.py): `name` is its general.architecture; `top` names the GGUF
    tensor of each module path in the model, `block` of each path inside a block (written as "blk.{i}.<name>");
    `permute_qk` when llama.cpp's graph rotates interleaved pairs, so that the rows of the attention's `q` and `k`
    projections are permuted per head from HF's rotate-half layout."""

    name: str
    block: dict[str, str]
    top: dict[str, str]
    permute_qk: bool = False


@dataclass(frozen=True)
class RotationSpec:
    """Where a rotation of the residual stream (methods/rotate.py) enters and leaves a block: `readers` are the
    RMSNorms that read the stream with the linears each feeds (the norm's weight is folded into them, then they read
    the rotated stream), `writers` the linears whose outputs are added to it, `online` the linears whose input can
    take an online Hadamard transform (QuaRot's: the down-projection, whose input no offline rotation reaches since
    the activation function sits before it). Only families whose norms are RMSNorms have one: a LayerNorm subtracts
    the mean, which does not commute with a rotation."""

    readers: tuple[tuple[str, tuple[str, ...]], ...]
    writers: tuple[str, ...]
    online: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts block as transformers 5 stores it: the experts of a block fused into one module at
    `path` (relative to the block) holding `gate_up` [experts, 2·intermediate, hidden] (gate rows first, then up)
    and `down` [experts, hidden, intermediate]. models/experts.py rewrites it as one gate/up/down triple of
    nn.Linear per expert (`<path>.<e>.gate_proj` ...) so that the methods see each expert's linears and only the
    tokens routed to it. `count` and `top_k` name the config attributes with the number of experts and how many
    of them each token goes to. `smoothing` are smoothing pairs naming experts with `{e}` for the expert's index,
    added to the family's own pairs: a pair whose source names `{e}` once per expert (an expert's up -> down), a pair
    whose targets alone do once, with the targets of every expert (the norm every expert reads)."""

    path: str
    count: str
    top_k: str = "num_experts_per_tok"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    activation: str = "act_fn"
    smoothing: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    family: str
    blocks: str  # the ModuleList of transformer blocks
    embeddings: tuple[str, ...]  # modules that run before the first block
    final_norm: str
    lm_head: str
    attention: AttentionSpec
    # (norm or linear, linears it feeds): where SmoothQuant/AWQ can fold per-channel scales.
    smoothing: tuple[tuple[str, tuple[str, ...]], ...]
    # The module computing RoPE's (cos, sin) from position ids, None when keys carry no rotary embedding.
    # KV-cache quantization reads it to quantize keys before rotation (rotate-half convention).
    rotary_embedding: str | None
    # The lean decode loop's map of a block; None where the family runs on transformers' own forward only.
    decoder: DecoderSpec | None = None
    # llama.cpp's names for the family's tensors; None where GGUF export does not cover it.
    gguf: GGUFSpec | None = None
    # Where a rotation of the residual stream is folded in; None where the family cannot be rotated.
    rotation: RotationSpec | None = None
    # The family's norms scale by (norm_offset + weight): Gemma's RMSNorm stores w and multiplies by (1 + w).
    # Folds (SmoothQuant, AWQ, the rotation) act on that effective scale and store it back less the offset.
    norm_offset: float = 0.0
    # Smoothing sources that cannot take a scale, with the reason: SmoothQuant and AWQ skip their pairs and log it
    # (the pair stays in `smoothing`, which also says which linears read one input).
    unsmoothable: tuple[tuple[str, str], ...] = ()
    # Why the lean decoder (runtime/) does not cover the family, when `decoder` is None: its refusal says so.
    decoder_missing: str | None = None
    # (config attribute, value) pairs the entry's paths assume; arch_for refuses a model with another value.
    requires: tuple[tuple[str, object], ...] = ()
    # (module path, its name in the family's safetensors files) where they differ: transformers renames some on
    # load (GPT-NeoX's head is `embed_out` on disk, `lm_head` in the model); block streaming reads the files.
    stored_names: tuple[tuple[str, str], ...] = ()
    # Mixture of experts: where a block's fused experts are; None for a dense family.
    experts: ExpertsSpec | None = None
    # Block linears that stay float whatever the plan says: a MoE router's or gate's rounding error changes which
    # experts a token goes to (or how much of the shared expert it takes), for a few bytes saved.
    float_layers: tuple[str, ...] = ()
    # (smoothing source, float modules that read it too): a scale folded into the source is multiplied into their
    # weight's input columns, so that they read what they read before (a MoE router reads the post-attention norm).
    float_readers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def routed(self) -> tuple[str, ...]:
        """Block-relative prefixes of the linears that read only the tokens routed to them (and may read none)."""
        return (self.experts.path + ".",) if self.experts is not None else ()


_LLAMA_LIKE = dict(
    blocks="model.layers",
    embeddings=("model.embed_tokens",),
    final_norm="model.norm",
    lm_head="lm_head",
    attention=AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                            o="self_attn.o_proj"),
    smoothing=(
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ),
    rotary_embedding="model.rotary_emb",
    rotation=RotationSpec(
        readers=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
        writers=("self_attn.o_proj", "mlp.down_proj"),
        online=("mlp.down_proj",),
    ),
)
_LLAMA_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LLAMA_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}

# Gemma 2/3: the MLP reads pre_feedforward_layernorm (post_attention_layernorm normalises the attention's output).
_GEMMA2_SMOOTHING = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
_OLMO_NORM = "OLMo's LayerNorm has no weight or bias to divide a scale into"

ARCHITECTURES: dict[str, ArchSpec] = {
    # llama.cpp's llama graph rotates interleaved pairs: q/k rows permuted per head.
    "llama": ArchSpec(family="llama", **_LLAMA_LIKE, decoder=DecoderSpec(),
                      gguf=GGUFSpec("llama", _LLAMA_GGUF_BLOCK, _LLAMA_GGUF_TOP, permute_qk=True)),
    "mistral": ArchSpec(family="mistral", **_LLAMA_LIKE, decoder=DecoderSpec(),  # llama.cpp runs Mistral as llama
                        gguf=GGUFSpec("llama", _LLAMA_GGUF_BLOCK, _LLAMA_GGUF_TOP, permute_qk=True)),
    "qwen2": ArchSpec(family="qwen2", **_LLAMA_LIKE, decoder=DecoderSpec(),
                      # rotate-half (NEOX) rope: rows as they are; q/k/v biases
                      gguf=GGUFSpec("qwen2", _LLAMA_GGUF_BLOCK, _LLAMA_GGUF_TOP)),
    "qwen3": ArchSpec(family="qwen3", **_LLAMA_LIKE,
                      decoder=DecoderSpec(qk_norm=("self_attn.q_norm", "self_attn.k_norm")),
                      gguf=GGUFSpec("qwen3", {**_LLAMA_GGUF_BLOCK, "self_attn.q_norm": "attn_q_norm",
                                              "self_attn.k_norm": "attn_k_norm"}, _LLAMA_GGUF_TOP)),
    "gpt2": ArchSpec(
        family="gpt2",
        blocks="transformer.h",
        embeddings=("transformer.wte", "transformer.wpe"),
        final_norm="transformer.ln_f",
        lm_head="lm_head",
        attention=AttentionSpec(q=None, k=None, v=None, o="attn.c_proj", qkv="attn.c_attn"),
        smoothing=(("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
        rotary_embedding=None,
        decoder_missing="learned positions instead of a rotary embedding, LayerNorms and a GELU MLP without a gate",
    ),
    "opt": ArchSpec(
        family="opt",
        blocks="model.decoder.layers",
        embeddings=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        final_norm="model.decoder.final_layer_norm",
        lm_head="lm_head",
        attention=AttentionSpec(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
                                o="self_attn.out_proj"),
        smoothing=(
            ("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("final_layer_norm", ("fc1",)),
        ),
        rotary_embedding=None,
        decoder_missing="learned positions instead of a rotary embedding, LayerNorms and a ReLU MLP without a gate",
    ),
    # Gemma: llama's layout, an embedding scaled by sqrt(hidden) inside its module, and RMSNorms that multiply by
    # (1 + w). GGUF not covered (llama.cpp's gemma stores 1 + w and scales in its graph).
    "gemma": ArchSpec(family="gemma", **_LLAMA_LIKE, decoder=DecoderSpec(), norm_offset=1.0),
    # Gemma 2 and 3: "sandwich" norms, a norm on the attention's and the MLP's outputs before the residual add
    # (post_attention_layernorm is one of them; pre_feedforward_layernorm feeds the MLP). A rotation would have to
    # pass through those output norms, so there is none.
    "gemma2": ArchSpec(
        family="gemma2", **(_LLAMA_LIKE | dict(smoothing=_GEMMA2_SMOOTHING, rotation=None)), norm_offset=1.0,
        decoder_missing="logit soft-capping (attention scores and final logits), the norms on the attention's and "
                        "the MLP's outputs, and sliding-window layers"),
    "gemma3_text": ArchSpec(
        family="gemma3_text", **(_LLAMA_LIKE | dict(smoothing=_GEMMA2_SMOOTHING, rotation=None)), norm_offset=1.0,
        decoder_missing="the norms on the attention's and the MLP's outputs, and local layers with their own "
                        "rotary base and sliding window"),
    # Phi-3: q/k/v fused in qkv_proj (queries, keys, values side by side), gate and up in gate_up_proj (gate
    # first). No v->o or up->down smoothing: the source would be a slice of a fused projection's rows.
    "phi3": ArchSpec(
        family="phi3",
        blocks="model.layers",
        embeddings=("model.embed_tokens",),
        final_norm="model.norm",
        lm_head="lm_head",
        attention=AttentionSpec(q=None, k=None, v=None, o="self_attn.o_proj", qkv="self_attn.qkv_proj"),
        smoothing=(("input_layernorm", ("self_attn.qkv_proj",)),
                   ("post_attention_layernorm", ("mlp.gate_up_proj",))),
        rotary_embedding="model.rotary_emb",
        decoder=DecoderSpec(gate_up="mlp.gate_up_proj", activation="mlp.activation_fn"),
        rotation=RotationSpec(
            readers=(("input_layernorm", ("self_attn.qkv_proj",)), ("post_attention_layernorm", ("mlp.gate_up_proj",))),
            writers=("self_attn.o_proj", "mlp.down_proj"),
            online=("mlp.down_proj",),
        ),
    ),
    # OLMo (1): llama's layout with a LayerNorm that has neither weight nor bias, and optional clipping of q/k/v.
    "olmo": ArchSpec(
        family="olmo", **(_LLAMA_LIKE | dict(rotation=None)),
        unsmoothable=(("input_layernorm", _OLMO_NORM), ("post_attention_layernorm", _OLMO_NORM)),
        decoder_missing="a LayerNorm without parameters (the loop runs RMSNorms) and clipping of q/k/v (clip_qkv)",
    ),
    # GPT-NeoX (Pythia): q/k/v fused per head in query_key_value, biases, LayerNorms, partial rotary embedding; with
    # use_parallel_residual attention and MLP read the same stream through their own norms (either way each norm
    # feeds one linear, so the smoothing pairs hold for both).
    "gpt_neox": ArchSpec(
        family="gpt_neox",
        blocks="gpt_neox.layers",
        embeddings=("gpt_neox.embed_in",),
        final_norm="gpt_neox.final_layer_norm",
        lm_head="lm_head",
        attention=AttentionSpec(q=None, k=None, v=None, o="attention.dense", qkv="attention.query_key_value",
                                qkv_layout="per_head"),
        smoothing=(("input_layernorm", ("attention.query_key_value",)),
                   ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
        rotary_embedding="gpt_neox.rotary_emb",
        decoder_missing="LayerNorms with biases, a GELU MLP without a gate, the per-head q/k/v layout and the "
                        "parallel residual",
        stored_names=(("lm_head", "embed_out"),),
    ),
    # Falcon (7B layout): multi-query attention fused in query_key_value (all query heads, then one key and one
    # value head), attention and MLP in parallel on one LayerNorm's output, so that norm feeds both.
    "falcon": ArchSpec(
        family="falcon",
        blocks="transformer.h",
        embeddings=("transformer.word_embeddings",),
        final_norm="transformer.ln_f",
        lm_head="lm_head",
        attention=AttentionSpec(q=None, k=None, v=None, o="self_attention.dense",
                                qkv="self_attention.query_key_value"),
        smoothing=(("input_layernorm", ("self_attention.query_key_value", "mlp.dense_h_to_4h")),),
        rotary_embedding="transformer.rotary_emb",
        decoder_missing="LayerNorms with biases, a GELU MLP without a gate and the parallel attention/MLP block",
        requires=(("new_decoder_architecture", False), ("parallel_attn", True), ("multi_query", True),
                  ("alibi", False)),
    ),
}

# Mixture of experts (transformers 5 fuses each block's experts into 3D parameters; models/experts.py splits them).
# The post-attention norm feeds every expert and the router: a scale folded into it is multiplied into the router's
# columns too (float_readers), so that routing is unchanged.
_MOE_BASE = {k: v for k, v in _LLAMA_LIKE.items() if k not in ("smoothing", "rotation")} | dict(
    decoder_missing="routed experts (a router choosing each token's experts, one small GEMM per expert)")
_MOE_ATTENTION_SMOOTHING = _LLAMA_LIKE["smoothing"][:2]
_EXPERT_SMOOTHING = (("post_attention_layernorm", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj")),
                     ("mlp.experts.{e}.up_proj", ("mlp.experts.{e}.down_proj",)))
ARCHITECTURES.update({
    # Mixtral's router is a MixtralTopKRouter (not a linear, never quantized); it is named here all the same.
    "mixtral": ArchSpec(family="mixtral", **_MOE_BASE, smoothing=_MOE_ATTENTION_SMOOTHING, float_layers=("mlp.gate",),
                        float_readers=(("post_attention_layernorm", ("mlp.gate",)),),
                        experts=ExpertsSpec("mlp.experts", count="num_local_experts", smoothing=_EXPERT_SMOOTHING)),
    # Qwen2-MoE adds a shared expert (a dense MLP every token reads) scaled by a sigmoid gate, an nn.Linear kept
    # float. Layers the config makes dense (`mlp_only_layers`) are quantized as plain MLPs, without smoothing.
    "qwen2_moe": ArchSpec(
        family="qwen2_moe", **_MOE_BASE,
        smoothing=(*_MOE_ATTENTION_SMOOTHING, ("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",))),
        float_layers=("mlp.gate", "mlp.shared_expert_gate"),
        float_readers=(("post_attention_layernorm", ("mlp.gate", "mlp.shared_expert_gate")),),
        experts=ExpertsSpec("mlp.experts", count="num_experts", smoothing=(
            ("post_attention_layernorm", ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                                          "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj")),
            _EXPERT_SMOOTHING[1]))),
    "qwen3_moe": ArchSpec(family="qwen3_moe", **_MOE_BASE, smoothing=_MOE_ATTENTION_SMOOTHING,
                          float_layers=("mlp.gate",), float_readers=(("post_attention_layernorm", ("mlp.gate",)),),
                          experts=ExpertsSpec("mlp.experts", count="num_experts", smoothing=_EXPERT_SMOOTHING)),
})

# How to read a linear-like module's weight as [out, in]. GPT-2's Conv1D stores it transposed; this table is
# the one place that knows.
LINEAR_WEIGHT: dict[type, Callable[[nn.Module], torch.Tensor]] = {
    nn.Linear: lambda m: m.weight,
    FalconLinear: lambda m: m.weight,  # nn.Linear's layout, its own forward
    Conv1D: lambda m: m.weight.t(),
}


def arch_for(model: nn.Module) -> ArchSpec:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"model family {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}. "
            "Add an entry to llmeasyquant/models/arch.py:ARCHITECTURES"
        )
    spec = ARCHITECTURES[model_type]
    for name, value in spec.requires:
        found = getattr(model.config, name, None)
        if found != value:
            raise ConfigError(
                f"this {model_type} model sets {name}={found!r}; the {model_type} entry of "
                f"llmeasyquant/models/arch.py:ARCHITECTURES covers {name}={value!r} only "
                f"({', '.join(f'{n}={v!r}' for n, v in spec.requires)}). Add a family entry for this layout"
            )
    if spec.experts is None:
        return spec
    return _with_experts(model_type, int(getattr(model.config, spec.experts.count)))


@cache
def _with_experts(model_type: str, experts: int) -> ArchSpec:
    """The family's entry with the smoothing pairs that name experts written out for `experts` experts."""
    spec = ARCHITECTURES[model_type]
    pairs: list[tuple[str, tuple[str, ...]]] = []
    for src, targets in spec.experts.smoothing:
        if "{e}" in src:  # one pair per expert
            pairs += [(src.format(e=e), tuple(t.format(e=e) for t in targets)) for e in range(experts)]
        else:  # one pair: the fixed targets, then each expert's
            every = tuple(t.format(e=e) for e in range(experts) for t in targets if "{e}" in t)
            pairs.append((src, tuple(t for t in targets if "{e}" not in t) + every))
    return replace(spec, smoothing=spec.smoothing + tuple(pairs))


def head_dim_of(config: object) -> int:
    """Channels per attention head: the config's `head_dim` where it sets one (Gemma, Qwen3), else hidden / heads."""
    heads = config.num_attention_heads
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def query_columns(attention: AttentionSpec, heads: int, head_dim: int) -> torch.Tensor | slice:
    """Which output columns of the attention's query projection (`q`, or the fused `qkv` in its `qkv_layout`) hold
    the queries, in head order."""
    if attention.q is not None or attention.qkv_layout == "concat":
        return slice(0, heads * head_dim)
    if attention.qkv_layout == "per_head":  # head h: columns [3h, 3h + 1) * head_dim are its query
        return (torch.arange(heads)[:, None] * 3 * head_dim + torch.arange(head_dim)[None, :]).flatten()
    raise ConfigError(f"unknown qkv_layout {attention.qkv_layout!r} in models/arch.py; use 'concat' or 'per_head'")


def stored_name(arch: ArchSpec, name: str) -> str:
    """The name a safetensors file of the family stores the model's tensor `name` under (`stored_names`)."""
    for path, stored in arch.stored_names:
        if name == path or name.startswith(path + "."):
            return stored + name[len(path):]
    return name


def is_linear(module: nn.Module) -> bool:
    return type(module) in LINEAR_WEIGHT


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear-like module as [out, in]."""
    return LINEAR_WEIGHT[type(module)](module)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half convention of the `rotary_embedding` families: (x1, x2) -> (-x2, x1) over the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with a `rotary_embedding` module's (cos, sin), as the family's attention applies it."""
    return x * cos + rotate_half(x) * sin


def get_module(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(get_module(root, parent_path), child, new)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return get_module(model, arch_for(model).blocks)
