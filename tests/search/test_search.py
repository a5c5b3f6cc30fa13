"""Mixed-precision search: the allocators (budget, optimality against brute force), sensitivities on a tiny model,
the plan's JSON round trip and exact size prediction, and the `search` CLI."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

import llmeasyquant as lq
from cli_helpers import assert_one_line_error, run
from llmeasyquant.errors import ConfigError
from llmeasyquant.export.checkpoint import bits_per_weight
from llmeasyquant.record import read_records
from llmeasyquant.search import Budget, MixedPrecisionSearch, solve_exact, solve_greedy
from llmeasyquant.search.sensitivity import code_entropy, layer_sensitivities


def brute_force(costs, losses, budget, lam=0.0) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        cost = sum(costs[i][j] for i, j in enumerate(choice))
        if cost <= budget:
            best = min(best, sum(losses[i][j] + lam * costs[i][j] for i, j in enumerate(choice)))
    return best


def random_instance(rng: random.Random, layers: int, candidates: int):
    costs, losses = [], []
    for _ in range(layers):
        size = rng.choice([3, 5, 8, 12])
        bits = sorted(rng.sample([2, 3, 4, 6, 8], candidates))
        costs.append([size * b for b in bits])
        losses.append(sorted((rng.uniform(0, 10) for _ in bits), reverse=True))  # more bits, less loss
    return costs, losses


# allocation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_exact_solver_is_optimal_and_within_budget(seed: int) -> None:
    rng = random.Random(seed)
    costs, losses = random_instance(rng, rng.randint(1, 5), rng.randint(2, 4))
    low, high = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = rng.randint(low, high)
    lam = rng.choice([0.0, 0.0, 0.05])
    result = solve_exact(costs, losses, budget, lam)
    assert result.cost <= budget and result.exact
    assert result.objective == pytest.approx(brute_force(costs, losses, budget, lam), abs=1e-9)
    assert result.cost == sum(costs[i][j] for i, j in enumerate(result.choice))
    greedy = solve_greedy(costs, losses, budget, lam)
    assert greedy.cost <= budget
    assert greedy.objective >= result.objective - 1e-9


def test_hand_made_instance_where_greedy_loses() -> None:
    # Budget 15 of 16 bits. Greedy lowers layer 0 first (6 lost over 10 bits saved beats 5 over 6) and ends at a
    # loss of 6; lowering layer 1 alone saves enough for a loss of 5.
    costs = [[0, 10], [0, 6]]
    losses = [[6.0, 0.0], [5.0, 0.0]]
    exact = solve_exact(costs, losses, 15)
    assert exact.choice == (1, 0) and exact.loss == 5.0 and exact.cost == 10
    greedy = solve_greedy(costs, losses, 15)
    assert greedy.choice == (0, 1) and greedy.loss == 6.0 and not greedy.exact


def test_budget_is_used_exactly_when_it_pays() -> None:
    costs = [[10, 20, 40]] * 3
    losses = [[4.0, 2.0, 0.0], [8.0, 3.0, 0.0], [16.0, 5.0, 0.0]]
    result = solve_exact(costs, losses, 80)
    assert result.cost == 80 and result.choice == (1, 1, 2) and result.loss == 5.0


def test_lambda_trades_quality_for_size() -> None:
    costs = [[10, 40]] * 2
    losses = [[1.0, 0.0], [1.0, 0.0]]
    assert solve_exact(costs, losses, 80).cost == 80
    assert solve_exact(costs, losses, 80, lam=0.1).cost == 20  # 30 bits saved outweigh a loss of 1


def test_coarse_states_still_respect_the_budget() -> None:
    rng = random.Random(7)
    costs, losses = random_instance(rng, 6, 4)
    costs = [[c * 1009 + rng.randint(0, 3) for c in row] for row in costs]  # odd costs: gcd 1
    budget = (sum(min(c) for c in costs) + sum(max(c) for c in costs)) // 2
    coarse = solve_exact(costs, losses, budget, max_states=50)
    assert coarse.cost <= budget and not coarse.exact
    assert coarse.objective >= brute_force(costs, losses, budget) - 1e-9


@pytest.mark.parametrize("costs, losses, budget, needle", [
    ([[10, 20]], [[1.0, 0.0]], 9, "below the cheapest allocation (10 bits"),
    ([[10, 20]], [[1.0]], 30, "2 costs for 1 losses"),
    ([[10, -1]], [[1.0, 0.0]], 30, "non-negative integers"),
    ([[10, 20]], [[float("nan"), 0.0]], 30, "finite"),
    ([], [], 30, "one cost and loss list per layer"),
])
def test_bad_instances_are_refused(costs, losses, budget, needle) -> None:
    for solver in (solve_exact, solve_greedy):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
            solver(costs, losses, budget)


# sensitivity and the search on a tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def calib() -> torch.Tensor:
    return torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(5))


def _names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


@pytest.mark.parametrize("kind, quantizer", [("kl", "gptq"), ("kl", "rtn"), ("output", "gptq"),
                                             ("hessian", "rtn"), ("entropy", "rtn")])
def test_sensitivities_fall_with_bits_and_leave_the_model_unchanged(tiny_llama, calib, kind, quantizer) -> None:
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    schemes = MixedPrecisionSearch(group_size=32).schemes()
    names = _names(tiny_llama)
    losses = layer_sensitivities(tiny_llama, names, schemes, kind, quantizer, calib, calib[:2, :32], progress=False)
    assert list(losses) == names
    for name, row in losses.items():
        assert len(row) == 4 and all(v >= 0 for v in row), (name, row)
        assert row[0] > row[-1], (name, row)  # 2 bits cost more than 8
    after = tiny_llama.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m) is torch.nn.Linear for n, m in tiny_llama.named_modules() if n in names)


def test_code_entropy_counts_information() -> None:
    scheme = lq.QuantScheme(8, False, lq.PerGroup(64))
    flat = torch.zeros(4, 64)
    flat[:, 0] = 1.0  # two values: at most 1 bit
    assert code_entropy(flat, scheme) <= 1.0
    spread = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    assert 5.0 < code_entropy(spread, scheme) <= 8.0


@pytest.mark.parametrize("sensitivity", ["kl", "entropy"])
def test_search_meets_the_budget_and_predicts_the_size_exactly(tiny_llama, calib, tmp_path: Path,
                                                               sensitivity: str) -> None:
    search = MixedPrecisionSearch(group_size=32, sensitivity=sensitivity, method="rtn", probe_tokens=32)
    result = search.run(tiny_llama, calib, Budget(avg_bits=3.6), progress=False)
    assert result.predicted["avg_bits"] <= 3.6
    assert len(set(layer.bits for layer in result.layers)) > 1  # mixed, not uniform
    path = result.save(tmp_path / "plan.json")
    plan = lq.Plan.load(path)  # the plan file is a plain plan with the search beside it
    assert plan == result.plan
    assert json.loads(path.read_text())["search"]["predicted"]["avg_bits"] == result.predicted["avg_bits"]
    resolved = plan.resolve(tiny_llama)
    assert {n: s.bits for n, s in resolved.items()} == {layer.name: layer.bits for layer in result.layers}
    quantized = lq.quantize(tiny_llama, lq.RTN(), plan, progress=False)
    assert bits_per_weight(quantized) == pytest.approx(result.predicted["avg_bits"], rel=1e-12)


def test_search_over_named_schemes_chooses_among_them(tiny_llama, calib) -> None:
    names = ("w8a16-g32", "w3a16-g32-asym", "w4a16-g32-learned")
    search = MixedPrecisionSearch(method="rtn", candidate_schemes=names, probe_tokens=32)
    assert [s.name for s in search.schemes()] == ["w3a16-g32-asym", "w4a16-g32-learned", "w8a16-g32"]
    result = search.run(tiny_llama, calib, Budget(avg_bits=4.8), progress=False)
    assert result.predicted["avg_bits"] <= 4.8
    chosen = {s.name for s in result.plan.resolve(tiny_llama).values()}
    assert chosen <= set(names) and len(chosen) > 1
    assert {layer.scheme for layer in result.layers} == chosen
    assert all(set(layer.loss) == set(names) for layer in result.layers)
    assert sum(result.scheme_histogram().values()) == sum(layer.weights for layer in result.layers)
    quantized = lq.quantize(tiny_llama, lq.RTN(), result.plan, progress=False)
    assert bits_per_weight(quantized) == pytest.approx(result.predicted["avg_bits"], rel=1e-12)


def test_a_rotated_search_measures_the_rotated_model_and_leaves_the_model_as_it_was(make_model, calib) -> None:
    model = make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = MixedPrecisionSearch(candidates=(2, 3), group_size=32, method="rtn", probe_tokens=32)
    rotated = MixedPrecisionSearch(candidates=(2, 3), group_size=32, method="rotate+rtn", probe_tokens=32)
    plain_losses = plain.measure(model, calib, progress=False).losses
    rotated_losses = rotated.measure(model, calib, progress=False).losses
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert plain_losses.keys() == rotated_losses.keys() and plain_losses != rotated_losses
    # what the rotated search measured is what the rotated recipe quantizes
    result = rotated.allocate(rotated.measure(model, calib, progress=False), Budget(avg_bits=3.0))
    quantized = lq.quantize(model, [lq.Rotate(), lq.RTN()], result.plan, progress=False)
    assert bits_per_weight(quantized) == pytest.approx(result.predicted["avg_bits"], rel=1e-12)


def test_search_is_deterministic(make_model, calib) -> None:
    search = MixedPrecisionSearch(group_size=32, probe_tokens=32)
    first = search.run(make_model("llama"), calib, Budget(avg_bits=3.5), progress=False)
    second = search.run(make_model("llama"), calib, Budget(avg_bits=3.5), progress=False)
    assert first.plan == second.plan and first.predicted == second.predicted


def test_byte_budget_and_gpt2(tiny_gpt2, calib) -> None:
    search = MixedPrecisionSearch(group_size=32, method="rtn", sensitivity="output")
    fixed = search.run(tiny_gpt2, calib, Budget(avg_bits=8.5), progress=False).predicted
    budget = fixed["tensor_bytes"] - 2000
    result = search.run(tiny_gpt2, calib, Budget(max_bytes=budget), progress=False)
    assert result.predicted["tensor_bytes"] <= budget


@pytest.mark.parametrize("options, budget, needle", [
    ({"candidates": (3, 5)}, Budget(avg_bits=4), "unsupported weight bit width 5"),
    ({"group_size": 0}, Budget(avg_bits=4), "group size must be a positive integer"),
    ({"sensitivity": "magic"}, Budget(avg_bits=4), "unknown sensitivity 'magic'"),
    ({"solver": "anneal"}, Budget(avg_bits=4), "unknown solver 'anneal'"),
    ({"candidates": ()}, Budget(avg_bits=4), "distinct bit widths"),
    ({"candidate_schemes": ("w4a16", "w4a16")}, Budget(avg_bits=4), "distinct"),
    ({"candidate_schemes": ("w4a8-g64", "w8a16")}, Budget(avg_bits=4), "quantizes activations.*weight-only"),
    ({"candidate_schemes": ("w4a16-g64-nf9",)}, Budget(avg_bits=4), "cannot read scheme"),
    ({"method": "awq+gptq"}, Budget(avg_bits=4), "whole-model transforms only"),
    ({"method": "rotate+awq"}, Budget(avg_bits=4), "quantizes with gptq or rtn"),
])
def test_bad_search_options(options, budget, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        MixedPrecisionSearch(**options)


def test_bad_budgets_and_missing_calibration(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="exactly one budget"):
        Budget()
    with pytest.raises(ConfigError, match="exactly one budget"):
        Budget(avg_bits=4, max_bytes=10)
    with pytest.raises(ConfigError, match="cheapest allocation"):
        MixedPrecisionSearch(method="rtn", sensitivity="entropy").run(tiny_llama, None, Budget(avg_bits=1.5),
                                                                       progress=False)
    with pytest.raises(ConfigError, match="needs calibration data"):
        MixedPrecisionSearch().run(tiny_llama, None, Budget(avg_bits=4), progress=False)


# CLI ---------------------------------------------------------------------------------------------------------


def test_search_cli_writes_a_plan_that_quantize_applies(capsys, llama_folder: Path, wiki_text: Path,
                                                        tmp_path: Path) -> None:
    plan, plot, record = tmp_path / "plan.json", tmp_path / "bits.png", tmp_path / "search.json"
    text = wiki_text.read_text()
    calib = tmp_path / "calib.txt"
    calib.write_text(text[len(text) // 2:])  # not the evaluation text
    code, out, err = run(capsys, "search", llama_folder, "--avg-bits", "4.5", "--group-size", "32", "--calib",
                         calib, "--calib-samples", "4", "--calib-seqlen", "32", "--probe-tokens", "32",
                         "--out", plan, "--plot", plot, "--json", record, "--verify", "--text", wiki_text,
                         "--seqlen", "32", "--max-windows", "2")
    assert code == 0, err
    assert "bits per quantized weight" in out and "measured:" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    measured = json.loads(plan.read_text())["search"]["measured"]
    assert measured["within_budget"] and measured["bits_per_weight"] <= 4.5
    assert read_records(record)[0].kind == "search"
    code, out, err = run(capsys, "quantize", llama_folder, "--method", "gptq", "--plan", plan, "--calib", calib,
                         "--calib-samples", "4", "--calib-seqlen", "32", "--out", tmp_path / "q")
    assert code == 0, err
    assert f"{measured['bits_per_weight']:.3f} bits per quantized weight" in out
    code, _, err = run(capsys, "search", llama_folder, "--avg-bits", "4.5", "--sensitivity", "entropy",
                       "--method", "rtn", "--out", plan)
    assert_one_line_error(code, err, "exists already", "--force")
    code, out, err = run(capsys, "search", llama_folder, "--avg-bits", "5", "--sensitivity", "entropy",
                         "--method", "rotate+rtn", "--candidates", "w3a16-g32-asym,w4a16-g32-nf4,w8a16-g32",
                         "--out", tmp_path / "named.json")
    assert code == 0, err
    shares = out.split("weights per candidate: ")[1].splitlines()[0]
    assert {part.split()[0] for part in shares.split(", ")} <= {"w3a16-g32-asym", "w4a16-g32-nf4", "w8a16-g32"}
    assert "--method rotate+rtn" in out
    code, out, err = run(capsys, "quantize", llama_folder, "--method", "rotate+rtn", "--plan", tmp_path / "named.json",
                         "--out", tmp_path / "rotated")
    assert code == 0, err
    code, _, err = run(capsys, "search", llama_folder, "--avg-bits", "4.5", "--calib", wiki_text, "--verify",
                       "--text", wiki_text, "--out", tmp_path / "other.json")
    assert_one_line_error(code, err, "same text")


@pytest.mark.parametrize("args, needles", [
    (["--avg-bits", "4", "--candidates", "2,x"], ["--candidates", "2,x"]),
    (["--avg-bits", "4", "--candidates", "3,w4a16-g64"], ["mixes bit widths and scheme names"]),
    (["--avg-bits", "4", "--candidates", "w4a8,w8a16", "--method", "rtn", "--sensitivity", "entropy"],
     ["w4a8", "weight-only"]),
    (["--avg-bits", "4", "--candidates", "3,6", "--method", "rtn", "--sensitivity", "entropy"], ["bit width 6"]),
    (["--avg-bits", "4"], ["needs calibration text", "--calib"]),
    (["--avg-bits", "1", "--method", "rtn", "--sensitivity", "entropy"], ["cheapest allocation"]),
])
def test_search_cli_errors(capsys, llama_folder: Path, tmp_path: Path, args, needles) -> None:
    code, _, err = run(capsys, "search", llama_folder, *args, "--out", tmp_path / "plan.json")
    assert_one_line_error(code, err, *needles)
