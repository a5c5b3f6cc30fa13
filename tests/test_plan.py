"""Plan: which linear layers of a model get which scheme, and its JSON form."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.plan import Plan, Rule
from llmeasyquant.scheme import W4A16_G128, W8A8, W8A16, parse_scheme

PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def block_linears(layers: range = range(2)) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in layers for p in PROJECTIONS]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).eval()


def test_tiny_model_has_the_expected_linears(model):
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(linears) == sorted([*block_linears(), "lm_head"])


def test_uniform_plan_takes_block_linears_but_not_lm_head(model):
    resolved = Plan.uniform(W4A16_G128).resolve(model)
    assert list(resolved) == block_linears()  # all 14, in model order
    assert len(resolved) == 14
    assert "lm_head" not in resolved
    assert "model.embed_tokens" not in resolved
    assert all(scheme == W4A16_G128 for scheme in resolved.values())


@pytest.mark.parametrize("pattern", ["lm_head", ".*lm_head", "(lm_head|model\\.norm)"])
def test_rule_naming_lm_head_includes_it(model, pattern):
    resolved = Plan((Rule(pattern, W8A16), Rule(".*", W4A16_G128))).resolve(model)
    assert resolved["lm_head"] == W8A16
    assert [n for n, s in resolved.items() if s == W4A16_G128] == block_linears()
    assert len(resolved) == 15


def test_lm_head_rule_after_catch_all_still_applies(model):
    # ".*" matches lm_head but does not name it, so it does not claim it; the later rule does.
    resolved = Plan((Rule(".*", W4A16_G128), Rule("lm_head", W8A16))).resolve(model)
    assert resolved["lm_head"] == W8A16
    assert all(resolved[n] == W4A16_G128 for n in block_linears())


def test_lm_head_alone(model):
    assert Plan((Rule("lm_head", W8A8),)).resolve(model) == {"lm_head": W8A8}


def test_embeddings_are_never_quantized(model):
    resolved = Plan((Rule("model.embed_tokens", W8A16), Rule(".*", W8A16))).resolve(model)
    assert "model.embed_tokens" not in resolved
    assert list(resolved) == block_linears()


def test_skip_rule_excludes_layers(model):
    plan = Plan((Rule(r"model\.layers\.0\..*", None), Rule(".*", W8A16)))
    assert list(plan.resolve(model)) == block_linears(range(1, 2))


def test_first_match_wins(model):
    # The catch-all first: the later skip rule is never reached.
    plan = Plan((Rule(".*", W8A16), Rule(r"model\.layers\.0\..*", None)))
    assert list(plan.resolve(model)) == block_linears()
    # Two schemes for the same layers: the earlier one is used.
    plan = Plan((Rule(r".*\.mlp\..*", W8A8), Rule(r".*_proj", W4A16_G128)))
    resolved = plan.resolve(model)
    assert list(resolved) == block_linears()
    for name, scheme in resolved.items():
        assert scheme == (W8A8 if ".mlp." in name else W4A16_G128), name


def test_skip_then_scheme_for_attention_only(model):
    plan = Plan((Rule(r".*down_proj", None), Rule(r".*self_attn\..*", W8A8)))
    resolved = plan.resolve(model)
    assert list(resolved) == [n for n in block_linears() if "self_attn" in n]
    assert len(resolved) == 8


def test_skip_rule_for_lm_head_wins_over_a_later_rule(model):
    plan = Plan((Rule("lm_head", None), Rule("lm_head", W8A16), Rule(".*", W8A16)))
    assert "lm_head" not in plan.resolve(model)


def test_mixed_precision_one_rule_per_layer(model):
    names = block_linears()
    schemes = [parse_scheme("w8a16"), parse_scheme("w4a16-g64"), parse_scheme("w3a16-g32")]
    plan = Plan(tuple(Rule(name.replace(".", r"\."), schemes[i % 3]) for i, name in enumerate(names)))
    assert plan.resolve(model) == {name: schemes[i % 3] for i, name in enumerate(names)}


def test_patterns_match_the_whole_name(model):
    assert Plan((Rule("q_proj", W8A16),)).resolve(model) == {}
    assert list(Plan((Rule(".*q_proj", W8A16),)).resolve(model)) == ["model.layers.0.self_attn.q_proj",
                                                                        "model.layers.1.self_attn.q_proj"]


def test_the_router_and_gates_of_a_mixture_of_experts_stay_float_whatever_the_rule():
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmeasyquant.models.experts import unfuse_experts

    config = AutoConfig.for_model("qwen2_moe", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=64, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1)
    model = unfuse_experts(AutoModelForCausalLM.from_config(config))
    assert isinstance(model.model.layers[0].mlp.shared_expert_gate, nn.Linear)
    resolved = Plan((Rule(r".*shared_expert_gate", W8A16), Rule(".*", W8A8))).resolve(model)
    assert not any(name.endswith(("mlp.gate", "shared_expert_gate")) for name in resolved)
    experts = {f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(2) for p in ("gate", "up", "down")}
    assert experts <= set(resolved)
    assert "model.layers.0.mlp.shared_expert.up_proj" in resolved


@pytest.mark.parametrize("pattern", ["(", "[a-", "*", "model.layers.(0"])
def test_invalid_regex(pattern):
    with pytest.raises(ConfigError, match="not a valid regular expression") as info:
        Rule(pattern, W8A16)
    assert repr(pattern) in str(info.value)
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        Plan.from_dict({"rules": [{"pattern": pattern, "scheme": None}]})


def test_unsupported_model_family():
    with pytest.raises(ConfigError, match="not supported"):
        Plan.uniform(W8A16).resolve(nn.Sequential(nn.Linear(4, 4)))


# serialisation --------------------------------------------------------------------------------------------------
PLANS = [
    Plan.uniform(W8A16),
    Plan.uniform(W8A8),
    Plan((Rule("lm_head", None), Rule(r"model\.layers\.0\..*", W8A8), Rule(".*", W4A16_G128))),
    Plan((Rule(".*down_proj", parse_scheme("w2a16-g64-asym")), Rule(".*", parse_scheme("w8a16-pt")))),
    Plan(()),
]


@pytest.mark.parametrize("plan", PLANS)
def test_dict_round_trip(plan):
    data = plan.to_dict()
    assert len(data["rules"]) == len(plan.rules)
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict(json.loads(json.dumps(data))) == plan


def test_to_dict_content():
    plan = Plan((Rule("lm_head", None), Rule(".*", W4A16_G128)))
    assert plan.to_dict() == {"rules": [
        {"pattern": "lm_head", "scheme": None},
        {"pattern": ".*", "scheme": {"bits": 4, "symmetric": False, "granularity": "group:128", "act": None}},
    ]}


@pytest.mark.parametrize("plan", PLANS)
def test_save_load_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text()) == plan.to_dict()
    assert Plan.load(path) == plan
    assert Plan.load(str(path)) == plan


def test_loaded_plan_resolves_the_same(model, tmp_path):
    plan = PLANS[2]
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").resolve(model) == plan.resolve(model)


def test_load_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="does not exist") as info:
        Plan.load(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        Plan.load(tmp_path)  # a directory is not a plan file


def test_load_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{rules: [")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Plan.load(path)


@pytest.mark.parametrize("data", [{}, {"rules": [{"pattern": ".*"}]}, {"rules": [{"scheme": None}]},
                                  {"rules": [{"pattern": ".*", "scheme": {"bits": 8}}]}, {"rules": None}])
def test_malformed_plan(data, tmp_path):
    with pytest.raises(ConfigError, match="malformed"):
        Plan.from_dict(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="malformed"):
        Plan.load(path)


def test_plan_with_bad_scheme_in_file(tmp_path):
    path = tmp_path / "plan.json"
    data = Plan.uniform(W8A16).to_dict()
    data["rules"][0]["scheme"]["bits"] = 5
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="bit width"):
        Plan.load(path)
