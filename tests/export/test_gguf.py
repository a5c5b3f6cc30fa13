"""GGUF export: our codes and scales bit for bit in Q8_0 / Q4_0 / Q4_1 blocks, q/k rows in llama.cpp's order (a
transformers reload gives the same logits), honest listing of what could not be kept exact, metadata, llama.cpp."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tests.models.test_arch import FAMILIES, tiny
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import llmeasyquant as lq
from llmeasyquant.errors import CheckpointError, ConfigError, OutputExistsError
from llmeasyquant.export.gguf import export_gguf, open_gguf_runtime
from llmeasyquant.export.gguf_blocks import unpack_blocks
from llmeasyquant.models.arch import ARCHITECTURES
from llmeasyquant.plan import Plan, Rule

HEADS, KV_HEADS = 4, 2
BLOCK_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _quantize(model: nn.Module, scheme: str) -> nn.Module:
    return lq.quantize(model, lq.RTN(), lq.parse_scheme(scheme), progress=False)


def _layers(model: nn.Module) -> dict[str, lq.QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, lq.QuantLinear)}


def _gguf_name(name: str) -> str:
    """model.layers.1.self_attn.q_proj -> blk.1.attn_q.weight"""
    parts = name.split(".")
    return f"blk.{parts[2]}.{BLOCK_NAMES[parts[-1]]}.weight"


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _field(path: Path, key: str):
    fields = gguf.GGUFReader(path).fields
    return fields[key].contents() if key in fields else None


def _hf_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows back to Hugging Face's rotate-half order (as transformers does)."""
    half = array.shape[0] // heads // 2
    return array.reshape(heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _as_hf(name: str, array: np.ndarray) -> np.ndarray:
    heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(name.rsplit(".", 1)[-1])
    return array if heads is None else _hf_rows(array, heads)


def _per_block(values: torch.Tensor, group_size: int, in_features: int) -> np.ndarray:
    return values.repeat_interleave(group_size // 32, dim=1)[:, : in_features // 32].numpy()


def _reference_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    for layer in _layers(model).values():
        layer.kernel_name = "reference"  # x @ dequantized weight: what a float runtime computes
        layer.forget_kernel()
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


# blocks hold our integers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scheme", "qtype"), [
    ("w8a16-g32", QType.Q8_0), ("w8a16", QType.Q8_0), ("w4a16-g32", QType.Q4_0), ("w2a16-g64", QType.Q4_0),
    ("w4a16-g32-asym", QType.Q4_1), ("w4a16-g64-asym", QType.Q4_1), ("w3a16-g32-asym", QType.Q4_1),
])
def test_blocks_hold_our_codes_and_scales_bit_for_bit(make_model, tiny_tokenizer, scheme: str, qtype: QType,
                                                      tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), scheme)
    result = export_gguf(model, tiny_tokenizer, tmp_path / "m.gguf")
    tensors = _tensors(result.path)
    layers = _layers(model)
    assert sorted(result.lossless) == sorted(layers) and result.requantized == []
    for name, layer in layers.items():
        tensor = tensors[_gguf_name(name)]
        assert tensor.tensor_type == qtype
        fields = {k: _as_hf(name, v) for k, v in unpack_blocks(tensor.data, qtype, layer.in_features).items()}
        qp = layer.qparams()
        d = _per_block(qp.scale, qp.group_size, layer.in_features)
        assert np.array_equal(fields["d"].view(np.uint16), d.astype(np.float16).view(np.uint16))  # same fp16 bits
        codes = layer.codes().numpy()
        assert np.array_equal(fields["q"], codes if qtype == QType.Q8_0 else codes + 8)
        if qtype == QType.Q4_1:
            zero = _per_block(qp.zero.float(), qp.group_size, layer.in_features)
            exact_m = -(zero + 8) * d  # float32: exact
            assert np.array_equal(fields["m"].view(np.uint16), exact_m.astype(np.float16).view(np.uint16))
    assert _field(result.path, "general.file_type") == {QType.Q8_0: 7, QType.Q4_0: 2, QType.Q4_1: 3}[qtype]


def test_q4_1_notes_its_rounded_offsets(make_model, tmp_path: Path) -> None:
    result = export_gguf(_quantize(make_model("llama"), "w4a16-g32-asym"), None, tmp_path / "m.gguf")
    assert any("rounded to fp16" in note for note in result.notes)


# transformers reads it back: q/k permutation, float tensors, families ----------------------------------------


def _family(kind: str, tie: bool = True) -> nn.Module:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=tie,
                 bos_token_id=1, eos_token_id=2)
    builders = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = builders[kind]
    # Qwen3's head_dim is not hidden / heads; transformers' GGUF loader does not read it back (llama.cpp does),
    # so the test keeps Qwen3Config's default of 128.
    extra = {"mistral": {"head_dim": 16}, "qwen3": {"head_dim": 128}}.get(kind, {})
    torch.manual_seed(0)
    model = model_cls(config_cls(**shape, **extra)).eval()
    for module in model.modules():  # norms away from 1 and nonzero biases, so a misplaced tensor shows
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            nn.init.normal_(module.bias, std=0.1)
        if "RMSNorm" in type(module).__name__:
            nn.init.normal_(module.weight, mean=1.0, std=0.2)
    model.llmeasyquant_source = f"tiny-random-{kind}"
    return model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", ["w8a16-g32", "w4a16-g32-asym"])
def test_transformers_reload_gives_the_same_weights_and_logits(kind: str, scheme: str, random_ids: torch.Tensor,
                                                               tmp_path: Path) -> None:
    model = _quantize(_family(kind), scheme)
    export_gguf(model, None, tmp_path / "m.gguf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    state = loaded.state_dict()
    # Q8_0 is exact; Q4_1 differs only by its fp16-rounded offset m (half an fp16 step of m at most).
    tol = 0.0 if scheme == "w8a16-g32" else 1e-4
    for name, layer in _layers(model).items():
        torch.testing.assert_close(state[f"{name}.weight"], layer.dequantize(), atol=tol, rtol=0)
        if layer.bias is not None:
            assert torch.equal(state[f"{name}.bias"], layer.bias.float())
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and name in state:
            assert torch.equal(state[name], tensor.float()), name
    torch.testing.assert_close(loaded(random_ids).logits, _reference_logits(model, random_ids),
                               atol=1e-3 if tol else 1e-5, rtol=0)


def test_untied_head_is_written_and_tied_one_is_not(random_ids: torch.Tensor, tmp_path: Path) -> None:
    tied = export_gguf(_quantize(_family("llama", tie=True), "w8a16-g32"), None, tmp_path / "tied.gguf")
    assert "output.weight" not in _tensors(tied.path)
    model = _quantize(_family("llama", tie=False), "w8a16-g32")
    untied = export_gguf(model, None, tmp_path / "untied.gguf")
    head = _tensors(untied.path)["output.weight"]
    assert head.tensor_type == QType.F16
    assert np.array_equal(head.data, model.lm_head.weight.detach().numpy().astype(np.float16))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="untied.gguf", dtype=torch.float32)
    torch.testing.assert_close(loaded(random_ids).logits, _reference_logits(model, random_ids), atol=1e-5, rtol=0)


def test_a_quantized_lm_head_is_written_as_blocks(tmp_path: Path) -> None:
    scheme = lq.parse_scheme("w8a16-g32")
    plan = Plan((Rule("lm_head", scheme), Rule(".*", scheme)))
    model = lq.quantize(_family("llama"), lq.RTN(), plan, progress=False)
    result = export_gguf(model, None, tmp_path / "m.gguf")
    assert _tensors(result.path)["output.weight"].tensor_type == QType.Q8_0
    assert "lm_head" in result.lossless


# what cannot be exact is said ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("scheme", "qtype"), [("w4a16-g48", QType.Q4_0), ("w8a16-g32-asym", QType.Q8_0),
                                               ("w2a16-g16-asym", QType.Q4_1)])
def test_layers_without_an_exact_block_type_are_requantized_with_one_warning(
        make_model, scheme: str, qtype: QType, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _quantize(make_model("llama"), scheme)
    with caplog.at_level(logging.WARNING, logger="llmeasyquant.export.gguf"):
        result = export_gguf(model, None, tmp_path / "m.gguf")
    layers = _layers(model)
    assert sorted(result.requantized) == sorted(layers) and result.lossless == []
    warnings = [r for r in caplog.records if "re-quantized" in r.getMessage()]
    assert len(warnings) == 1 and all(name in warnings[0].getMessage() for name in layers)
    tensors = _tensors(result.path)
    for name, layer in layers.items():
        tensor = tensors[_gguf_name(name)]
        assert tensor.tensor_type == qtype
        back = _as_hf(name, gguf.quants.dequantize(tensor.data, qtype))
        weight = layer.dequantize().numpy()
        # One more rounding of the dequantized weight, llama.cpp's: half a step for Q8_0 (absmax / 127) and Q4_1
        # ((max - min) / 15), a whole step where Q4_0 clips the side opposite its signed maximum (absmax / 8).
        absmax = np.abs(weight).max(axis=1, keepdims=True)
        bound = {QType.Q8_0: 0.5 / 127, QType.Q4_0: 1 / 8, QType.Q4_1: 1 / 15}[qtype]
        assert np.all(np.abs(back - weight) <= absmax * (bound + 2e-3))


def test_rows_too_short_for_blocks_are_written_as_f16(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=80, num_hidden_layers=1, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=256, max_position_embeddings=64)
    model = _quantize(LlamaForCausalLM(config).eval(), "w8a16-g32")
    with caplog.at_level(logging.WARNING, logger="llmeasyquant.export.gguf"):
        result = export_gguf(model, None, tmp_path / "m.gguf")
    assert result.requantized == ["model.layers.0.mlp.down_proj"]  # in_features 80
    assert any("F16" in r.getMessage() and "down_proj" in r.getMessage() for r in caplog.records)
    down = _tensors(result.path)["blk.0.ffn_down.weight"]
    assert down.tensor_type == QType.F16
    assert np.array_equal(down.data, model.model.layers[0].mlp.down_proj.dequantize().numpy().astype(np.float16))


# metadata ------------------------------------------------------------------------------------------------------


def test_metadata_describes_the_model_and_its_tokenizer(make_model, tiny_tokenizer, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), "w8a16-g32")
    path = export_gguf(model, tiny_tokenizer, tmp_path / "m.gguf").path
    expected = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
                "llama.feed_forward_length": 128, "llama.attention.head_count": HEADS,
                "llama.attention.head_count_kv": KV_HEADS, "llama.rope.dimension_count": 16,
                "llama.context_length": 256, "llama.vocab_size": 256, "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "general.quantization_version": 2}
    assert {key: _field(path, key) for key in expected} == expected
    assert _field(path, "llama.rope.freq_base") == pytest.approx(10000.0)
    tokens = _field(path, "tokenizer.ggml.tokens")
    assert len(tokens) == 256 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    vocab = tiny_tokenizer.get_vocab()
    assert all(tokens[i] == token for token, i in vocab.items())
    assert _field(path, "tokenizer.ggml.token_type")[1] == gguf.TokenType.CONTROL
    assert len(_field(path, "tokenizer.ggml.merges")) > 0


def test_without_a_tokenizer_the_file_has_none_and_a_warning_says_so(make_model, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="llmeasyquant.export.gguf"):
        path = export_gguf(_quantize(make_model("llama"), "w8a16-g32"), None, tmp_path / "m.gguf").path
    assert _field(path, "tokenizer.ggml.tokens") is None
    assert any("without tokenizer" in r.getMessage() for r in caplog.records)


def test_metadata_is_copied_from_a_source_gguf(make_model, tiny_tokenizer, tmp_path: Path) -> None:
    source = export_gguf(_quantize(make_model("llama"), "w8a16-g32"), tiny_tokenizer, tmp_path / "src.gguf").path
    model = make_model("llama")
    model.llmeasyquant_source = str(source)  # as load_model() records a .gguf it loaded
    path = export_gguf(_quantize(model, "w4a16-g32"), None, tmp_path / "m.gguf").path
    assert _field(path, "tokenizer.ggml.tokens") == _field(source, "tokenizer.ggml.tokens")
    assert _field(path, "tokenizer.ggml.merges") == _field(source, "tokenizer.ggml.merges")
    assert _field(path, "general.name") == _field(source, "general.name")
    assert _field(path, "general.file_type") == 2  # the new file's own type, not the source's (7)


# refusals ------------------------------------------------------------------------------------------------------


def test_existing_output_is_refused_without_force_and_replaced_with_it(make_model, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), "w8a16-g32")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"not a gguf file")
    with pytest.raises(OutputExistsError, match="--force"):
        export_gguf(model, None, out)
    assert out.read_bytes() == b"not a gguf file"
    export_gguf(model, None, out, force=True)
    assert len(_tensors(out)) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left behind


def test_a_model_that_is_not_quantized_is_refused(make_model, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no quantized layers"):
        export_gguf(make_model("llama"), None, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_an_unsupported_family_is_refused_naming_the_supported_ones(make_model, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'gpt2'.*llama, mistral, qwen2"):
        export_gguf(_quantize(make_model("gpt2"), "w8a16-g32"), None, tmp_path / "m.gguf")


# llama.cpp -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "scheme"), [("llama", "w8a16-g32"), ("llama", "w4a16-g32-asym"),
                                            ("mistral", "w8a16"), ("qwen2", "w4a16-g32"), ("qwen3", "w4a16-g64-asym")])
def test_llama_cpp_runs_the_file_with_our_logits(tiny_tokenizer, kind: str, scheme: str, random_ids: torch.Tensor,
                                                 tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    model = _quantize(_family(kind), scheme)
    path = export_gguf(model, tiny_tokenizer, tmp_path / "m.gguf").path
    run = open_gguf_runtime(path, n_ctx=64, threads=2)
    ids = random_ids[0]
    ours = _reference_logits(model, ids[None])[0]
    theirs = run(ids)
    assert theirs.shape == (len(ids), 256) and theirs.dtype == torch.float32
    # llama.cpp rounds activations to 8 bits per block of 32 before its integer dot products: close, not equal.
    torch.testing.assert_close(theirs, ours, atol=0.03, rtol=0)
    assert torch.equal(run(ids), theirs)  # each call starts a fresh sequence
    with pytest.raises(ConfigError, match="n_ctx"):
        run(torch.zeros(65, dtype=torch.long))


def test_runtime_names_a_missing_file(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_gguf_runtime(tmp_path / "missing.gguf", n_ctx=64)


def test_runtime_without_llama_cpp_names_the_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if it were not installed
    with pytest.raises(ImportError, match="pip install llama-cpp-python"):
        open_gguf_runtime(tmp_path / "m.gguf", n_ctx=64)


# SmolLM2 -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_in_llama_cpp_matches_our_quantized_model(wiki_text: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from llmeasyquant.models.load import bundled_gguf, load_model

    model, tokenizer = load_model("smollm2-135m")
    _quantize(model, "w8a16-g32")
    result = export_gguf(model, tokenizer, tmp_path / "smol.gguf")
    assert len(result.lossless) == 210 and result.requantized == []
    assert _field(result.path, "tokenizer.ggml.pre") == _field(bundled_gguf(), "tokenizer.ggml.pre")
    ids = torch.tensor(tokenizer(wiki_text.read_text(), add_special_tokens=False).input_ids[:512])
    with torch.no_grad():
        ours = model(ids[None]).logits[0].float()
    theirs = open_gguf_runtime(result.path, n_ctx=512)(ids)

    def ppl(logits: torch.Tensor) -> float:
        return math.exp(nn.functional.cross_entropy(logits[:-1], ids[1:]).item())

    # Measured on the bundled file itself, llama.cpp and PyTorch differ by ~0.4% ppl and ~97% top-1 agreement.
    assert ppl(theirs) == pytest.approx(ppl(ours), rel=0.02)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.93


# non-uniform grids -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["w4a16-g32-iq4nl", "w4a16-g64-iq4nl", "w4a16-iq4nl"])
def test_iq4nl_grid_is_written_as_iq4_nl_bit_for_bit(make_model, scheme: str, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), scheme)
    result = export_gguf(model, None, tmp_path / "m.gguf")
    layers = _layers(model)
    assert sorted(result.lossless) == sorted(layers) and result.requantized == []
    tensors = _tensors(result.path)
    for name, layer in layers.items():
        tensor = tensors[_gguf_name(name)]
        assert tensor.tensor_type == QType.IQ4_NL
        fields = {k: _as_hf(name, v) for k, v in unpack_blocks(tensor.data, QType.IQ4_NL, layer.in_features).items()}
        assert np.array_equal(fields["q"], layer.codes().numpy() + 8)
        # gguf's dequantization (d * kvalues_iq4nl[n], as llama.cpp's dequantize_row_iq4_nl) gives our weight exactly.
        back = _as_hf(name, gguf.quants.dequantize(tensor.data, QType.IQ4_NL))
        assert np.array_equal(back, layer.dequantize().numpy())
    assert _field(result.path, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_IQ4_NL)


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g32-learned", "w4a16-g48-iq4nl", "w3a16-g32-learned"])
def test_other_grids_are_requantized_to_iq4_nl_and_noted(make_model, scheme: str, tmp_path: Path) -> None:
    model = _quantize(make_model("llama"), scheme)
    result = export_gguf(model, None, tmp_path / "m.gguf")
    layers = _layers(model)
    assert sorted(result.requantized) == sorted(layers) and result.lossless == []
    assert any("re-quantized to IQ4_NL" in note for note in result.notes)
    tensors = _tensors(result.path)
    for name, layer in layers.items():
        tensor = tensors[_gguf_name(name)]
        assert tensor.tensor_type == QType.IQ4_NL
        back = _as_hf(name, gguf.quants.dequantize(tensor.data, QType.IQ4_NL))
        weight = layer.dequantize().numpy()
        # One more rounding on IQ4_NL's grid: half its widest step (24 / 128) plus the at most 20% a block's scale
        # search may clip of its largest value; on average far less.
        absmax = np.abs(weight).max(axis=1, keepdims=True)
        assert np.all(np.abs(back - weight) <= absmax * (12 / 128 + 0.2))
        assert np.abs(back - weight).mean() < 0.1 * np.abs(weight).mean()


@pytest.mark.parametrize("family", [f for f in FAMILIES if ARCHITECTURES[f].gguf is None and f not in ("gpt2", "opt")])
def test_the_families_gguf_does_not_cover_are_refused(family: str, tmp_path: Path) -> None:
    """Gemma (llama.cpp stores its norms as 1 + w), Phi-3, OLMo, GPT-NeoX and Falcon have no GGUF names here."""
    with pytest.raises(ConfigError, match=f"does not support the model family '{family}'"):
        export_gguf(_quantize(tiny(family), "w8a16"), None, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
