"""A pre-norm rotary decoder taken apart for the engine's forward (runtime/batch.py, and runtime/native_step.py
for its native step): its embedding, its blocks' norms and linears as plain callables, the final norm, the head and
the rotary tables, read once from the model's own modules (the families whose arch entry has a `decoder` map).

Calling `.forward` of each module skips nn.Module.__call__'s hook bookkeeping on the hot path; QuantLinear layers
run through their kernels (an online input transform included: nn/transform.py), and layers fused by
`fuse_shared_inputs` run as one GEMM. A module with forward pre-hooks (a float linear left unquantized by the plan
that carries rotate's online transform) is called whole, so that they run (`callable_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.kernels import native
from llmeasyquant.models.arch import arch_for, get_module

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: nn.Module, offset: float = 0.0) -> Norm:
        """The RMSNorm `module`; `offset` is the family's `norm_offset` (Gemma scales by 1 + w: the sum is taken
        once here, so the loop's operators see a plain RMSNorm weight)."""
        eps = next((getattr(module, name) for name in ("variance_epsilon", "eps") if hasattr(module, name)), None)
        if eps is None:
            raise ConfigError(f"{type(module).__name__} has no epsilon the lean decoder can read")
        weight = module.weight if not offset else (module.weight.detach() + offset).contiguous()
        return cls(weight, float(eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


NO_NORM = Norm(None, 0.0)  # type: ignore[arg-type]  # what the fused rotary operators read as "no q/k norm"

# A config's `hidden_act` -> the native gated activation computing it (kernels/native/step_kinds.h); others run on
# PyTorch operators. gelu_new is the same tanh approximation as gelu_pytorch_tanh.
NATIVE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class Projection:
    """One of a block's projections: its members' outputs side by side (a single member where q/k/v or gate/up
    run as one GEMM, or the model stores them fused); the native step reads the members' layers."""

    members: tuple[Linear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.members) == 1:
            return self.members[0](x)
        return torch.cat([member(x) for member in self.members], dim=-1)


@dataclass(frozen=True)
class Block:
    attn_norm: Norm
    qkv: Projection  # [T, hidden] -> [T, (heads + 2 kv_heads) * head_dim]: q, k, v side by side
    qk_norm: tuple[Norm, Norm] | None
    o: Projection
    mlp_norm: Norm
    gate_up: Projection  # [T, hidden] -> [T, 2 * intermediate]: gate then up
    activation: Callable[[torch.Tensor], torch.Tensor]
    down: Projection

    @property
    def projections(self) -> tuple[Projection, Projection, Projection, Projection]:
        """qkv, o, gate_up, down: the order of the native step's projections."""
        return self.qkv, self.o, self.gate_up, self.down


def callable_of(module: nn.Module) -> Linear:
    """`module.forward`, or the module itself where forward pre-hooks change its input (they must run)."""
    return module if module._forward_pre_hooks else module.forward


def joined(members: list[nn.Module]) -> Projection:
    """The members' outputs side by side: their fused group's single GEMM when `fuse_shared_inputs` joined them,
    else each layer in turn."""
    shared = [getattr(m, "shared", None) for m in members]
    if shared[0] is not None and all(s is not None and s[0] is shared[0][0] and s[1] == i
                                     for i, s in enumerate(shared)):
        return Projection((shared[0][0].combined.forward,))
    return Projection(tuple(callable_of(m) for m in members))


class DecoderParts:
    """The model's parts for `max_tokens` positions; `fused_ops` is the compiled operator module where the model
    is fp32 with a gated activation the fused operators compute (`activation`, GATE_ACTIVATIONS), else None."""

    def __init__(self, model: nn.Module, max_tokens: int, fused: bool = True) -> None:
        arch = arch_for(model)
        spec = arch.decoder
        if spec is None:
            missing = f": it has {arch.decoder_missing}" if arch.decoder_missing else ""
            raise ConfigError(f"the lean decode loop does not cover the {arch.family} family (no `decoder` entry in "
                              f"models/arch.py{missing}); run it on transformers' forward instead "
                              "(--runtime transformers)")
        if arch.attention.q is None and arch.attention.qkv_layout != "concat":
            raise ConfigError(f"the lean decode loop reads a fused q/k/v as queries, keys, values side by side; the "
                              f"{arch.family} entry's layout is {arch.attention.qkv_layout!r}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        config = model.config
        blocks = get_module(model, arch.blocks)
        attention = get_module(blocks[0], spec.attention)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = int(attention.head_dim), float(attention.scaling)
        for block in blocks:
            # Per layer where the family sets it per layer (Qwen2/3), else the config's (Mistral).
            window = getattr(get_module(block, spec.attention), "sliding_window",
                             getattr(config, "sliding_window", None))
            if window is not None and window < max_tokens:
                raise ConfigError(f"this model attends over a sliding window of {window} tokens; the lean decoder "
                                  f"keeps full attention, so it runs at most {window} tokens (asked: {max_tokens})")
        self.embed = get_module(model, arch.embeddings[0])
        self.final_norm = Norm.of(get_module(model, arch.final_norm), arch.norm_offset)
        self.lm_head = get_module(model, arch.lm_head).forward
        self.blocks = [self._block(block, arch, spec) for block in blocks]
        self.dtype = self.embed.weight.dtype
        rotary = get_module(model, arch.rotary_embedding)
        cos, sin = rotary(torch.zeros(1, dtype=self.dtype), torch.arange(max_tokens)[None])  # [1, max, head_dim]
        if cos.shape[-1] != self.head_dim:
            raise ConfigError(f"this {arch.family} model rotates {cos.shape[-1]} of its {self.head_dim} channels per "
                              "head (a partial rotary embedding); the lean decode loop rotates whole heads. Run it "
                              "on transformers' forward instead (--runtime transformers)")
        self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()  # [max, dim]
        self.max_tokens = max_tokens
        # The fused operators work on fp32 rows and compute the activations of NATIVE_ACTIVATIONS; anything else
        # steps on PyTorch operators.
        self.activation = NATIVE_ACTIVATIONS.get(getattr(config, "hidden_act", None))
        covered = self.dtype == torch.float32 and self.activation is not None
        self.fused_ops = native.ops() if fused and covered else None

    @staticmethod
    def _block(block: nn.Module, arch, spec) -> Block:
        def at(path: str) -> nn.Module:
            return get_module(block, path)

        attention, offset = arch.attention, arch.norm_offset
        qk_norm = None
        if spec.qk_norm is not None:
            qk_norm = (Norm.of(at(spec.qk_norm[0]), offset), Norm.of(at(spec.qk_norm[1]), offset))
        # A fused projection (Phi-3's qkv_proj, gate_up_proj) already gives the members side by side.
        qkv = (joined([at(attention.q), at(attention.k), at(attention.v)]) if attention.q is not None
               else Projection((callable_of(at(attention.qkv)),)))
        gate_up = (joined([at(spec.gate), at(spec.up)]) if spec.gate_up is None
                   else Projection((callable_of(at(spec.gate_up)),)))
        return Block(
            attn_norm=Norm.of(at(spec.attn_norm), offset),
            qkv=qkv,
            qk_norm=qk_norm,
            o=Projection((callable_of(at(attention.o)),)),
            mlp_norm=Norm.of(at(spec.mlp_norm), offset),
            gate_up=gate_up,
            activation=at(spec.activation),
            down=Projection((callable_of(at(spec.down)),)),
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [rows, vocab] of final hidden states [rows, hidden]."""
        return self.lm_head(self.final_norm(hidden))
