"""SmoothQuant: the float function is unchanged by smoothing, outliers move into weights, W8A8 error drops."""

from __future__ import annotations

import copy

import pytest
import torch

import llmeasyquant as lq
from llmeasyquant.calibration.sequential import run_sequential
from llmeasyquant.cli import main
from llmeasyquant.methods import SmoothQuant, recipe_by_name
from llmeasyquant.methods.smoothquant import smoothing_scales
from llmeasyquant.models.arch import arch_for, is_linear


def with_activation_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Scale a few channels of each norm up and the linears it feeds down: same function, outlier activations."""
    arch = arch_for(model)
    with torch.no_grad():
        for block in model.get_submodule(arch.blocks):
            for source, targets in arch.smoothing:
                norm = block.get_submodule(source)
                if is_linear(norm):
                    continue
                factor = torch.ones_like(norm.weight)
                factor[[3, 17]] = 40.0
                norm.weight.mul_(factor)
                if getattr(norm, "bias", None) is not None:
                    norm.bias.mul_(factor)
                for t in targets:
                    lq.models.arch.linear_weight(block.get_submodule(t)).div_(factor[None, :])
    return model


@pytest.fixture
def calib() -> torch.Tensor:
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(5))


def test_smoothing_leaves_the_float_function_unchanged(model_kind, make_model, calib, random_ids):
    model = with_activation_outliers(make_model(model_kind))
    with torch.no_grad():
        before = model(random_ids).logits
    plan = lq.Plan.uniform(lq.W8A8).resolve(model)
    run_sequential(model, [SmoothQuant(alpha=0.5)], plan, calib, progress=False)
    assert not any(isinstance(m, lq.QuantLinear) for m in model.modules())
    with torch.no_grad():
        after = model(random_ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_smoothing_flattens_the_activations(make_model, calib):
    model = with_activation_outliers(make_model("llama"))
    layer = model.model.layers[0].self_attn.q_proj
    seen = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(a[0].abs().amax(dim=(0, 1))))
    with torch.no_grad():
        model(calib)
        before = seen.pop()
        run_sequential(model, [SmoothQuant(alpha=0.5)], lq.Plan.uniform(lq.W8A8).resolve(model), calib,
                       progress=False)
        model(calib)
        after = seen.pop()
    handle.remove()
    assert after.max() / after.median() < 0.5 * before.max() / before.median()


def test_smoothquant_lowers_w8a8_error(model_kind, make_model, calib, random_ids):
    base = with_activation_outliers(make_model(model_kind))
    with torch.no_grad():
        reference = base(random_ids).logits
    rtn = lq.quantize(copy.deepcopy(base), lq.RTN(), lq.W8A8, calib=calib, progress=False)
    smooth = lq.quantize(copy.deepcopy(base), [SmoothQuant(0.5), lq.RTN()], lq.W8A8, calib=calib, progress=False)
    with torch.no_grad():
        err_rtn = (rtn(random_ids).logits - reference).pow(2).mean()
        err_smooth = (smooth(random_ids).logits - reference).pow(2).mean()
    assert err_smooth < 0.7 * err_rtn
    assert sum(b.output_rel_error for b in smooth.llmeasyquant.blocks) < sum(
        b.output_rel_error for b in rtn.llmeasyquant.blocks)


def test_smoothing_scales_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    weights = [torch.tensor([[1.0, 2.0, 1.0, 0.0]]), torch.tensor([[0.5, 4.0, 3.0, 0.0]])]
    s = smoothing_scales(act, weights, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))  # zero activation or weight: scale 1


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_out_of_range(alpha):
    with pytest.raises(lq.ConfigError, match="alpha"):
        SmoothQuant(alpha=alpha)


def test_recipes_by_name():
    assert [m.name for m in recipe_by_name("smoothquant")] == ["smoothquant", "rtn"]
    recipe = recipe_by_name("smoothquant+gptq", alpha=0.8, act_order=True)
    assert recipe[0].alpha == 0.8 and recipe[1].act_order is True
    with pytest.raises(lq.ConfigError, match="no method"):
        recipe_by_name("rtn", alpha=0.5)
    with pytest.raises(lq.ConfigError, match="unknown method"):
        recipe_by_name("smoothquant+foo")


def test_quantizer_must_come_last(tiny_llama, calib):
    with pytest.raises(lq.ConfigError, match="one quantizer"):
        lq.quantize(tiny_llama, [lq.GPTQ(), SmoothQuant()], lq.W8A8, calib=calib, progress=False)


def test_cli_smoothquant(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "sq"
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "smoothquant", "--alpha", "1.5",
                 "--act-bits", "8", "--calib", str(wiki_text), "--out", str(out)]) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "smoothquant", "--alpha", "0.8",
                 "--act-bits", "8", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert [r["method"] for r in model.llmeasyquant.recipe] == ["smoothquant", "rtn"]
    assert model.llmeasyquant.recipe[0]["alpha"] == 0.8


def test_alpha_auto_picks_the_grid_value_with_the_lowest_block_error(make_model, calib):
    """On block 0 (whose inputs do not depend on earlier choices) auto is at least as good as every fixed alpha."""
    base = with_activation_outliers(make_model("llama"))
    grid = (0.2, 0.5, 0.8)
    auto = lq.quantize(copy.deepcopy(base), [SmoothQuant("auto", alpha_grid=grid, search_samples=len(calib)),
                                             lq.RTN()], lq.W8A8, calib=calib, progress=False)
    chosen = [b.choices["alpha"] for b in auto.llmeasyquant.blocks]
    assert all(a in grid for a in chosen)
    fixed = {a: lq.quantize(copy.deepcopy(base), [SmoothQuant(a), lq.RTN()], lq.W8A8, calib=calib, progress=False)
             for a in grid}
    errors = {a: m.llmeasyquant.blocks[0].output_rel_error for a, m in fixed.items()}
    assert auto.llmeasyquant.blocks[0].output_rel_error == pytest.approx(min(errors.values()), rel=1e-5)
    assert errors[chosen[0]] == pytest.approx(min(errors.values()), rel=1e-5)


@pytest.mark.parametrize("bad", ["best", 1.5])
def test_alpha_auto_and_grid_validation(bad):
    with pytest.raises(lq.ConfigError, match="alpha"):
        SmoothQuant(alpha=bad)
    with pytest.raises(lq.ConfigError, match="alpha_grid"):
        SmoothQuant(alpha="auto", alpha_grid=(0.5, 1.2))
    with pytest.raises(lq.ConfigError, match="search_samples"):
        SmoothQuant(alpha="auto", search_samples=0)


def test_smoothquant_then_gptq_reads_the_statistics_of_one_pass(tiny_llama, calib, monkeypatch):
    """Smoothing rescales the Hessians exactly, so GPTQ after it costs no second pass over the block."""
    import llmeasyquant.calibration.sequential as sequential
    import llmeasyquant.methods.base as base

    passes = []
    original = sequential.collect_input_stats

    def counted(*args, **kwargs):
        passes.append(kwargs.get("want"))
        return original(*args, **kwargs)

    monkeypatch.setattr(sequential, "collect_input_stats", counted)
    monkeypatch.setattr(base, "collect_input_stats", counted)
    lq.quantize(tiny_llama, recipe_by_name("smoothquant+gptq", alpha=0.5), lq.W8A8, calib=calib, progress=False)
    assert len(passes) == 2  # one per block
    assert all(want == frozenset({"hessian", "range"}) for want in passes)


def test_carried_hessians_equal_fresh_ones(tiny_llama, calib):
    from llmeasyquant.calibration.sequential import capture_block_inputs
    from llmeasyquant.methods import BlockContext
    from llmeasyquant.methods.stats import collect_input_stats

    model = with_activation_outliers(tiny_llama)
    inputs, kwargs = capture_block_inputs(model, calib)
    block = model.model.layers[0]
    names = [n.split("layers.0.", 1)[1] for n in lq.Plan.uniform(lq.W8A8).resolve(model) if "layers.0." in n]
    ctx = BlockContext(index=0, prefix="model.layers.0.", plan=dict.fromkeys(names, lq.W8A8),
                       arch=arch_for(model), inputs=inputs, kwargs=kwargs)
    ctx.input_stats, _ = collect_input_stats(block, names, inputs, kwargs, want=frozenset({"hessian", "range"}))
    SmoothQuant(alpha=0.7).apply(block, ctx)
    fresh, _ = collect_input_stats(block, names, inputs, kwargs, want=frozenset({"hessian"}))
    for name in names:
        torch.testing.assert_close(ctx.input_stats.hessian[name], fresh.hessian[name], rtol=1e-3, atol=1e-5)


def test_cli_alpha_auto(llama_folder, wiki_text, tmp_path, capsys):
    out = tmp_path / "sq-auto"
    with pytest.raises(SystemExit) as exit_info:
        main(["--quiet", "quantize", str(llama_folder), "--method", "smoothquant", "--alpha", "wild",
              "--act-bits", "8", "--calib", str(wiki_text), "--out", str(out)])
    assert exit_info.value.code == 2 and "'auto'" in capsys.readouterr().err
    assert main(["--quiet", "quantize", str(llama_folder), "--method", "smoothquant", "--alpha", "auto",
                 "--act-bits", "8", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
                 "--out", str(out)]) == 0
    model, _ = lq.load(out)
    assert model.llmeasyquant.recipe[0]["alpha"] == "auto"
