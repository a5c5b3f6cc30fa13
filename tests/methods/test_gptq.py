"""GPTQ: lower layer output error than RTN on the same data, valid codes, determinism, CLI and calibration checks."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.data import calibration_ids
from llmeasyquant.cli import main
from llmeasyquant.methods import gptq
from llmeasyquant.methods.gptq import gptq_solve, inverse_factor_
from llmeasyquant.primitives import choose_qparams, dequantize, qrange, quantize
from llmeasyquant.scheme import parse_scheme
from llmeasyquant.texts import shipped_bytes


def correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels and a few large ones, like a transformer's."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=gen) / width**0.5
    x = torch.randn(tokens, width, generator=gen) @ mix
    x[:, :4] *= 8
    return x


@pytest.mark.parametrize("scheme", ["w4a16-g32", "w4a16-g32-asym", "w4a16-g48-asym", "w3a16-g64", "w4a16",
                                    "w8a16", "w2a16-g32-asym"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_below_rtn(scheme, act_order):
    width, out = 160, 48  # 160 is not a multiple of 48 or 64: partial last groups
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out, width, generator=gen) * 0.05
    x = correlated_inputs(512, width)
    hessian = 2 * x.t() @ x / x.shape[0]
    s = lq.parse_scheme(scheme)
    codes, qp = gptq_solve(weight, hessian, s, block_size=32, act_order=act_order)
    qmin, qmax = qrange(s.bits)
    assert codes.dtype == torch.int8 and int(codes.min()) >= qmin and int(codes.max()) <= qmax
    rtn_qp = choose_qparams(weight, s.bits, s.symmetric, s.granularity)
    rtn = dequantize(quantize(weight, rtn_qp, s.bits), rtn_qp)
    gptq = dequantize(codes, qp)
    err_rtn = (x @ (rtn - weight).t()).pow(2).sum()
    err_gptq = (x @ (gptq - weight).t()).pow(2).sum()
    assert err_gptq < 0.9 * err_rtn, (float(err_gptq), float(err_rtn))
    layer = lq.QuantLinear.from_codes(codes, qp, s, None)  # the codes fit the storage of the scheme
    torch.testing.assert_close(layer.dequantize(), gptq)


def test_dead_inputs_get_zero_weight():
    weight = torch.randn(8, 32) * 0.1
    x = correlated_inputs(64, 32)
    x[:, 5] = 0
    codes, qp = gptq_solve(weight, 2 * x.t() @ x / 64, lq.parse_scheme("w4a16-g16-asym"))
    assert torch.allclose(dequantize(codes, qp)[:, 5], torch.zeros(8), atol=float(qp.scale.max()) / 2 + 1e-6)


def test_gptq_on_tiny_models_is_deterministic_and_beats_rtn(model_kind, make_model, random_ids):
    base = make_model(model_kind)
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    scheme = lq.parse_scheme("w3a16-g32-asym")
    first = lq.quantize(copy.deepcopy(base), lq.GPTQ(), scheme, calib=calib, progress=False)
    second = lq.quantize(copy.deepcopy(base), lq.GPTQ(), scheme, calib=calib, progress=False)
    state1, state2 = first.state_dict(), second.state_dict()
    assert all(torch.equal(state1[k], state2[k]) for k in state1)
    rtn = lq.quantize(copy.deepcopy(base), lq.RTN(), scheme, calib=calib, progress=False)
    gptq_err = sum(r.output_rel_error for r in first.llmeasyquant.blocks)
    rtn_err = sum(r.output_rel_error for r in rtn.llmeasyquant.blocks)
    assert gptq_err < rtn_err
    with torch.no_grad():
        reference = base(random_ids).logits
        assert (first(random_ids).logits - reference).pow(2).mean() < (rtn(random_ids).logits - reference).pow(2).mean()


def test_gptq_without_calibration_is_a_clear_error(tiny_llama):
    with pytest.raises(lq.ConfigError, match="calibration"):
        lq.quantize(tiny_llama, lq.GPTQ(), lq.W8A16, progress=False)


def test_unknown_method_option_is_a_clear_error():
    from llmeasyquant.methods import method_by_name

    with pytest.raises(lq.ConfigError, match="act_order"):
        method_by_name("rtn", act_order=True)


def test_calibrating_on_the_evaluation_split_is_refused(tiny_llama, tiny_tokenizer, tmp_path):
    copied = tmp_path / "renamed.txt"  # recognised by its bytes, whatever the file is called
    copied.write_bytes(shipped_bytes("wikitext2", "test")[0])
    with pytest.raises(lq.DataError, match="refused"):
        calibration_ids(str(copied), tiny_llama, tiny_tokenizer, samples=4, seqlen=32)


def test_calibration_ids_are_consecutive_chunks(tiny_llama, tiny_tokenizer, wiki_text):
    ids, source = calibration_ids(str(wiki_text), tiny_llama, tiny_tokenizer, samples=5, seqlen=16)
    expected = tiny_tokenizer(source.text, add_special_tokens=False, return_tensors="pt").input_ids[0][:80]
    assert torch.equal(ids, expected.reshape(5, 16))


def test_cli_gptq_needs_calib_then_works(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "gptq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--out", str(out)]) == 2
    assert "--calib" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--act-order", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert model.llmeasyquant.recipe[0]["method"] == "gptq" and model.llmeasyquant.recipe[0]["act_order"] is True
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--no-act-order", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out), "--force"]) == 0
    assert lq.load(out)[0].llmeasyquant.recipe[0]["act_order"] is False
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rtn", "--act-order", "--out",
                 str(tmp_path / "x")]) == 2


def test_act_order_is_the_default():
    """As in llm-compressor; without it symmetric 4-bit GPTQ on SmolLM2 is worse than round to nearest."""
    assert lq.GPTQ().act_order is True


@pytest.mark.parametrize("scheme", ["w4a16-g32-nf4", "w4a16-g48-iq4nl", "w4a16-g32-learned", "w4a16-nf4",
                                    "w3a16-g32-learned"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_a_grid_beats_rtn_on_the_same_grid(scheme, act_order):
    width, out = 160, 48
    weight = torch.randn(out, width, generator=torch.Generator().manual_seed(1)) * 0.05
    x = correlated_inputs(512, width)
    hessian = 2 * x.t() @ x / x.shape[0]
    s = lq.parse_scheme(scheme)
    codes, qp = gptq_solve(weight, hessian, s, block_size=32, act_order=act_order)
    assert qp.levels is not None and qp.zero is None
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    rtn = lq.QuantLinear.from_weight(weight, None, s).dequantize()
    layer = lq.QuantLinear.from_codes(codes, qp, s, None)
    gptq = layer.dequantize()
    assert torch.equal(gptq, dequantize(codes, qp))  # the stored layer holds exactly the solved values
    err_rtn = (x @ (rtn - weight).t()).pow(2).sum()
    err_gptq = (x @ (gptq - weight).t()).pow(2).sum()
    assert err_gptq < 0.9 * err_rtn, (float(err_gptq), float(err_rtn))
    again, _ = gptq_solve(weight, hessian, s, block_size=32, act_order=act_order)
    assert torch.equal(again, codes)


def test_inverse_factor_is_the_upper_factor_of_the_inverse_in_place_on_fixed_threads():
    x = torch.randn(256, 48, generator=torch.Generator().manual_seed(5))
    h = x.t() @ x + torch.eye(48)
    before = torch.get_num_threads()
    work = h.clone()
    factor = inverse_factor_(work)
    assert factor is work  # in place: no second copy of a large H
    assert torch.get_num_threads() == before  # the process's thread count is given back
    assert factor.dtype == torch.float32 and torch.equal(torch.triu(factor), factor)
    torch.testing.assert_close(factor.double().t() @ factor.double(), torch.linalg.inv(h.double()),
                               rtol=1e-4, atol=1e-7)
    torch.set_num_threads(2 if before == 1 else 1)
    try:
        assert torch.equal(inverse_factor_(h.clone()), factor)  # whatever the caller's thread count
    finally:
        torch.set_num_threads(before)


def test_solving_in_the_hessians_memory_gives_the_same_codes():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(512, 96, generator=g) * torch.rand(96, generator=g) * 3
    h = 2 * x.t() @ x / 512
    weight = torch.randn(40, 96, generator=g)
    s = lq.parse_scheme("w4a16-g32")
    codes, qp = gptq_solve(weight, h, s, act_order=True)
    work = h.clone()
    again, qp_again = gptq_solve(weight, work, s, act_order=True, consume=True)
    assert torch.equal(codes, again) and torch.equal(qp.scale, qp_again.scale)
    assert not torch.equal(work, h)  # it was the workspace


def test_true_sequential_solves_each_input_group_on_the_quantized_groups_before_it(tiny_llama):
    """Block 0: q/k/v (the first group) get the same codes either way; o_proj's codes are those GPTQ gives on the
    Hessian of o_proj's input recomputed with the block's q/k/v quantized (and differ from the float pass's)."""
    from llmeasyquant.calibration.sequential import capture_block_inputs
    from llmeasyquant.methods.gptq import gptq_solve
    from llmeasyquant.methods.stats import collect_input_stats

    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    scheme = lq.parse_scheme("w4a16-g32")
    plain = lq.quantize(copy.deepcopy(tiny_llama), lq.GPTQ(), scheme, calib=calib, progress=False)
    seq = lq.quantize(copy.deepcopy(tiny_llama), lq.GPTQ(true_sequential=True), scheme, calib=calib, progress=False)
    assert seq.llmeasyquant.recipe[0]["true_sequential"] is True
    plain_attn, seq_attn = plain.model.layers[0].self_attn, seq.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(plain_attn, name).codes(), getattr(seq_attn, name).codes())
    assert not torch.equal(plain_attn.o_proj.codes(), seq_attn.o_proj.codes())

    block = copy.deepcopy(tiny_llama.model.layers[0])
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(block.self_attn, name, copy.deepcopy(getattr(seq_attn, name)))
    inputs, kwargs = capture_block_inputs(tiny_llama, calib)
    stats, _ = collect_input_stats(block, ["self_attn.o_proj"], inputs, kwargs, want=frozenset({"hessian"}))
    codes, _ = gptq_solve(block.self_attn.o_proj.weight.detach().float(), stats.hessian["self_attn.o_proj"], scheme,
                          act_order=True)
    assert torch.equal(codes, seq_attn.o_proj.codes())


def test_input_groups_follow_the_layers_that_read_one_input(tiny_llama):
    from llmeasyquant.calibration.sequential import capture_block_inputs
    from llmeasyquant.methods.gptq import input_groups
    from llmeasyquant.methods.stats import collect_input_stats

    block = tiny_llama.model.layers[0]
    names = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]
    inputs, kwargs = capture_block_inputs(tiny_llama, torch.randint(0, 256, (2, 16)))
    stats, _ = collect_input_stats(block, names, inputs, kwargs, want=frozenset({"hessian"}))
    assert input_groups(stats, names) == [names[:3], names[3:4], names[4:6], names[6:]]


def test_quantizers_that_pass_over_the_block_again_are_not_shared_out_over_ranks():
    """Under torch.distributed the runner shares out only layers that solve on the first pass's statistics; the
    others run whole on every rank (their equality with one process: tests/infra/test_distributed.py)."""
    assert lq.GPTQ().solves_apart and lq.RTN().solves_apart and lq.ZeroQuant(lkd=False).solves_apart
    assert not lq.GPTQ(true_sequential=True).solves_apart
    assert not lq.GPTAQ().solves_apart and not lq.ZeroQuant().solves_apart


def test_cli_true_sequential_reaches_gptq_and_only_gptq(llama_folder, wiki_text, tmp_path):
    out = tmp_path / "seq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--true-sequential", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    assert lq.load(out)[0].llmeasyquant.recipe[0]["true_sequential"] is True
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "rtn", "--true-sequential", "--out",
                 str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("scheme_name", ["w4a16-g32", "w4a16-g32-asym", "w3a16-g16-asym", "w8a16", "w2a16-g64-asym"])
@pytest.mark.parametrize("act_order", [True, False])
def test_the_native_column_loop_gives_the_python_loops_bits(monkeypatch: pytest.MonkeyPatch, ops, scheme_name: str,
                                                             act_order: bool):
    g = torch.Generator().manual_seed(17)
    x = torch.randn(300, 96, generator=g) * torch.logspace(-2, 1, 96)  # channels of different scales
    hessian = 2 * x.t() @ x / 300
    weight = torch.randn(40, 96, generator=g)
    weight[:, 5] *= 30  # an outlier column
    scheme = parse_scheme(scheme_name)
    native = gptq_solve(weight, hessian, scheme, block_size=24, act_order=act_order)
    monkeypatch.setattr(gptq, "ops", lambda: None)
    python = gptq_solve(weight, hessian, scheme, block_size=24, act_order=act_order)
    assert torch.equal(native[0], python[0])
    assert torch.equal(native[1].scale, python[1].scale)
    assert (native[1].zero is None) == (python[1].zero is None)
    if native[1].zero is not None:
        assert torch.equal(native[1].zero, python[1].zero)
