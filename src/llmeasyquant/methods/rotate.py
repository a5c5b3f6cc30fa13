"""Rotate: an orthogonal rotation of the residual stream folded into the weights (QuaRot's and SpinQuant's first
step), so that the outlier channels of the hidden states are spread over all channels before anything is quantized.

The model computes the same function in float. With Q orthogonal [hidden, hidden] and the hidden state h (a row)
replaced by h Q everywhere:
- each RMSNorm that reads the stream first has its weight folded into the linears it feeds (W <- W diag(w), w <- 1),
  since RMS(h Q) = RMS(h) holds only for the plain norm;
- linears reading the stream take W <- W Q (W x = (W Q)(Q^T x)); linears writing to it take W <- Q^T W and
  b <- Q^T b; the embeddings' rows become E Q;
- the final norm's weight goes into the head, W_head <- W_head diag(w) Q. A head tied to the embeddings is untied,
  since E Q and E diag(w) Q differ (the head is then stored on its own).
The rotation of the whole stream is folded offline, so nothing changes at run time: every runtime and export format
that runs the model runs the rotated one.

The online part (`online_down=True`, QuaRot's online Hadamard): the down-projection reads act(gate) * up, which no
offline rotation reaches (the activation sits between up and down), and whose few huge channels set the scale of
W8A8's activations and the Hessian of GPTQ. Each down-projection then takes W <- W Q' offline and applies x -> x Q'
to its input at run time (nn/transform.py; the fast transform in kernels/hadamard.py), Q' of the same construction
over the intermediate size with the same seed: 1536 = 512 * 3 uses H of order 512 (9 butterfly stages at run time)
and O of order 3. `online_attention=True` does the same for the attention output projection, whose input (the
heads' outputs side by side) no offline rotation of the stream reaches either; it spreads that input's outliers for
4-bit activations. The float function is unchanged; the transform runs wherever the layer runs (it is part of the
layer), and exporters that cannot express it refuse the model.

The matrix: a random Hadamard-like rotation of the hidden size d = 2^a * m (m odd), Q = diag(s) (H ⊗ O) / sqrt(2^a),
with H the Walsh-Hadamard matrix of order 2^a (Sylvester), O a random orthogonal matrix of order m (the QR of a
Gaussian matrix, signs fixed) and s random signs, all from `seed`: 576 = 64 * 9 uses H of order 64 and O of order 9.
The same inputs and seed give the same matrix, bit for bit. (H ⊗ O is orthogonal for any orthogonal O; a random O
mixes the m channels of each group, where a fixed O, e.g. a DFT, would serve as well: random keeps one construction
for the stream and the online transform.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.kernels.hadamard import hadamard_matrix, walsh_hadamard
from llmeasyquant.methods.base import ModelTransform
from llmeasyquant.models.arch import ArchSpec, get_module, linear_weight
from llmeasyquant.nn.transform import HadamardTransform, attach_input_transform, input_transform_of

__all__ = ["Rotate", "random_orthogonal", "rotation_factors", "rotation_matrix", "walsh_hadamard"]

log = logging.getLogger(__name__)


def random_orthogonal(order: int, generator: torch.Generator) -> torch.Tensor:
    """A random orthogonal matrix (Haar distributed): the Q of a Gaussian matrix's QR, its signs fixed by R's
    diagonal (float64)."""
    q, r = torch.linalg.qr(torch.randn(order, order, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))[None, :]).contiguous()


def rotation_factors(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The random parts of the module docstring's Q: the signs s [size] and O [m, m] ([[1]] when size is a power of
    two), float64."""
    if size < 1:
        raise ConfigError(f"cannot rotate a stream of {size} channels")
    power = size & -size  # the largest power of two dividing size
    odd = size // power
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.float64) * 2 - 1
    orthogonal = random_orthogonal(odd, generator) if odd > 1 else torch.ones(1, 1, dtype=torch.float64)
    return signs, orthogonal


def rotation_matrix(size: int, seed: int = 0) -> torch.Tensor:
    """The module docstring's Q [size, size] (float64, orthogonal)."""
    return hadamard_matrix(*rotation_factors(size, seed))


def _fold_norm_into(norm: nn.Module, linears: list[nn.Module], offset: float = 0.0) -> None:
    """W <- W diag(offset + w) for each linear the RMSNorm feeds (`offset`: the family's `norm_offset`, 1 for
    Gemma's 1 + w), then the norm's scale becomes 1 (w <- 1 - offset)."""
    weight = norm.weight.detach().double() + offset
    for linear in linears:
        w = linear_weight(linear)
        w.data.copy_((w.detach().double() * weight[None, :]).to(w.dtype))
    norm.weight.data.fill_(1.0 - offset)


def _rotate_input(linear: nn.Module, q: torch.Tensor) -> None:
    w = linear_weight(linear)
    w.data.copy_((w.detach().double() @ q).to(w.dtype))


def _rotate_output(linear: nn.Module, q: torch.Tensor) -> None:
    w = linear_weight(linear)
    w.data.copy_((q.T @ w.detach().double()).to(w.dtype))
    if getattr(linear, "bias", None) is not None:
        linear.bias.data.copy_((linear.bias.detach().double() @ q).to(linear.bias.dtype))


@dataclass(frozen=True)
class Rotate(ModelTransform):
    """A rotation of the residual stream folded into the weights (module docstring); `seed` picks the matrix.
    `online_down`: also an online Hadamard transform of each down-projection's input; `online_attention`: of each
    attention output projection's input, the heads' outputs side by side (module docstring)."""

    name: ClassVar[str] = "rotate"
    default_scheme: ClassVar[str] = "w4a16-g128-asym"
    seed: int = 0
    online_down: bool = False
    online_attention: bool = False

    def apply_model(self, model: nn.Module, arch: ArchSpec) -> None:
        spec = arch.rotation
        if spec is None:
            raise ConfigError(f"the {arch.family} family cannot be rotated (no `rotation` in its models/arch.py "
                              "entry): a LayerNorm subtracts the mean, and a norm on a block's outputs (Gemma 2/3) "
                              "sits between the linears and the stream, neither of which commutes with a rotation; a "
                              "mixture of experts' router reads the stream, which the rotation does not follow yet; "
                              "use a recipe without 'rotate'")
        hidden = int(model.config.get_text_config().hidden_size)
        q = rotation_matrix(hidden, self.seed)
        with torch.no_grad():
            self._untie_head(model, arch)
            for path in arch.embeddings:
                embedding = get_module(model, path).weight
                if embedding.shape[-1] != hidden:
                    raise ConfigError(f"{path} has {embedding.shape[-1]} channels, the stream {hidden}")
                embedding.data.copy_((embedding.detach().double() @ q).to(embedding.dtype))
            for block in get_module(model, arch.blocks):
                for norm_path, readers in spec.readers:
                    linears = [get_module(block, path) for path in readers]
                    _fold_norm_into(get_module(block, norm_path), linears, arch.norm_offset)
                    for linear in linears:
                        _rotate_input(linear, q)
                for path in spec.writers:
                    _rotate_output(get_module(block, path), q)
            head = get_module(model, arch.lm_head)
            _fold_norm_into(get_module(model, arch.final_norm), [head], arch.norm_offset)
            _rotate_input(head, q)
            online = self._online_paths(arch)
            if online:
                self._transform_online(model, arch, online)
        log.info("rotated the residual stream of %d channels (seed %d) into the weights%s", hidden, self.seed,
                 f", with an online Hadamard transform of the input of {', '.join(online)}" if online else "")

    def _online_paths(self, arch: ArchSpec) -> tuple[str, ...]:
        """The linears (paths in a block) that transform their input online, as the options ask."""
        paths: tuple[str, ...] = ()
        if self.online_down:
            if not arch.rotation.online:
                raise ConfigError(f"the {arch.family} family names no linear for an online Hadamard transform; "
                                  "rotate without it (--no-online-rotation)")
            paths += arch.rotation.online
        if self.online_attention:
            # The heads' outputs reach o_proj side by side; nothing between them and it but the head concatenation,
            # so any orthogonal Q on o_proj's input is exact (W <- W Q, x -> x Q), as for the down projection.
            paths += (arch.attention.o,)
        return paths

    def _transform_online(self, model: nn.Module, arch: ArchSpec, paths: tuple[str, ...]) -> None:
        """W <- W Q for each linear of `paths`, which then applies x -> x Q to its input at run time."""
        factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for block in get_module(model, arch.blocks):
            for path in paths:
                linear = get_module(block, path)
                if input_transform_of(linear) is not None:
                    raise ConfigError(f"{path} already applies an online Hadamard transform: this model was rotated "
                                      "before; rotate a fresh copy of the model")
                width = linear_weight(linear).shape[1]
                if width not in factors:
                    factors[width] = rotation_factors(width, self.seed)
                transform = HadamardTransform(*factors[width])  # its own buffers: one per layer in checkpoints
                _rotate_input(linear, transform.matrix())  # the fp32 factors the layer will run
                attach_input_transform(linear, transform)

    @staticmethod
    def _untie_head(model: nn.Module, arch: ArchSpec) -> None:
        """A head that shares the embeddings' weight gets its own copy: rotated, the embeddings become E Q and the
        head E diag(w) Q."""
        head = get_module(model, arch.lm_head)
        if any(head.weight is get_module(model, path).weight for path in arch.embeddings):
            head.weight = nn.Parameter(head.weight.detach().clone())
            model.config.tie_word_embeddings = False
            model.config.get_text_config().tie_word_embeddings = False
