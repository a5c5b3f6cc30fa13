"""Schemes: names, parsing, dict round trips, presets, and the errors a user sees for impossible settings."""

from __future__ import annotations

import json
import re

import pytest

from llmeasyquant.errors import ConfigError
from llmeasyquant.scheme import (
    PRESETS,
    SUPPORTED_BITS,
    W4A8_G128,
    W4A16_G64,
    W4A16_G128,
    W8A8,
    W8A16,
    ActMode,
    ActScheme,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantScheme,
    granularity_from_str,
    granularity_to_str,
    make_scheme,
    parse_scheme,
)

GRANULARITIES = [PerTensor(), PerChannel(), PerGroup(32), PerGroup(64), PerGroup(128), PerGroup(7), PerGroup(1000)]
ACTS = [None, ActScheme()]
ALL_SCHEMES = [
    QuantScheme(bits=bits, symmetric=symmetric, granularity=granularity, act=act)
    for bits in SUPPORTED_BITS
    for symmetric in (True, False)
    for granularity in GRANULARITIES
    for act in ACTS
]


# parsing ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("w8a16", QuantScheme(8)),
        ("w8a8", QuantScheme(8, act=ActScheme())),
        ("w8a8-asym", QuantScheme(8, symmetric=False, act=ActScheme())),
        ("w4a16-g64", QuantScheme(4, granularity=PerGroup(64))),
        ("w4a16-g128-asym", QuantScheme(4, symmetric=False, granularity=PerGroup(128))),
        ("w8a16-pt", QuantScheme(8, granularity=PerTensor())),
        ("w3a16-g32", QuantScheme(3, granularity=PerGroup(32))),
        ("w2a16-g64-asym", QuantScheme(2, symmetric=False, granularity=PerGroup(64))),
        ("w4a8-g128", QuantScheme(4, granularity=PerGroup(128), act=ActScheme())),
        ("w4a16-sym", QuantScheme(4)),
        ("w8a8-apt", QuantScheme(8, act=ActScheme(granularity=PerTensor()))),
        ("w8a8-aasym-g64", QuantScheme(8, granularity=PerGroup(64), act=ActScheme(symmetric=False))),
        ("W4A16-G64-ASYM", QuantScheme(4, symmetric=False, granularity=PerGroup(64))),
        ("  w8a16  ", QuantScheme(8)),
    ],
)
def test_parse_scheme_known_names(text, expected):
    scheme = parse_scheme(text)
    assert scheme == expected
    # The fields separately, so that a broken __eq__ cannot hide a wrong parse.
    assert (scheme.bits, scheme.symmetric, scheme.granularity, scheme.act) == (
        expected.bits, expected.symmetric, expected.granularity, expected.act)


def test_parse_scheme_a16_means_no_activation_quantization():
    assert parse_scheme("w4a16-g32").act is None
    act = parse_scheme("w8a8").act
    assert act is not None
    assert (act.bits, act.symmetric, act.mode, act.granularity) == (8, True, ActMode.DYNAMIC, PerToken())


@pytest.mark.parametrize("scheme", ALL_SCHEMES, ids=lambda s: f"{s.name}-{type(s.granularity).__name__}")
def test_name_round_trip(scheme):
    assert parse_scheme(scheme.name) == scheme
    assert parse_scheme(scheme.name.upper()) == scheme


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        (QuantScheme(8), "w8a16"),
        (QuantScheme(8, act=ActScheme()), "w8a8"),
        (QuantScheme(4, symmetric=False, granularity=PerGroup(128)), "w4a16-g128-asym"),
        (QuantScheme(8, granularity=PerTensor()), "w8a16-pt"),
        (QuantScheme(2, symmetric=False, granularity=PerTensor(), act=ActScheme()), "w2a8-pt-asym"),
        (QuantScheme(3, granularity=PerGroup(32)), "w3a16-g32"),
    ],
)
def test_name_text(scheme, name):
    assert scheme.name == name


def test_group_size_property():
    assert QuantScheme(4, granularity=PerGroup(64)).group_size == 64
    assert QuantScheme(4, granularity=PerChannel()).group_size is None
    assert QuantScheme(4, granularity=PerTensor()).group_size is None


@pytest.mark.parametrize("act", [ActScheme(granularity=PerTensor()), ActScheme(symmetric=False),
                                 ActScheme(symmetric=False, granularity=PerTensor())],
                         ids=["per-tensor-act", "asym-act", "asym-per-tensor-act"])
@pytest.mark.parametrize("granularity", [PerChannel(), PerGroup(128), PerTensor()])
@pytest.mark.parametrize("symmetric", [True, False])
def test_name_round_trip_non_default_activation(act, granularity, symmetric):
    """Schemes that differ only on the activation side must not share a name (runs use it as a folder name)."""
    scheme = QuantScheme(8, symmetric=symmetric, granularity=granularity, act=act)
    assert scheme.name != QuantScheme(8, symmetric=symmetric, granularity=granularity, act=ActScheme()).name
    assert parse_scheme(scheme.name) == scheme


@pytest.mark.parametrize("act", [ActScheme(bits=4, clip=0.9), ActScheme(clip=0.875, symmetric=False),
                                 ActScheme(clip=0.5, granularity=PerTensor())])
def test_clipped_activations_name_and_dict_round_trip(act):
    scheme = QuantScheme(4, symmetric=False, granularity=PerGroup(64), act=act)
    assert "-ac" in scheme.name and scheme.name != QuantScheme(4, False, PerGroup(64), ActScheme(bits=act.bits)).name
    assert parse_scheme(scheme.name) == scheme
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert scheme.to_dict()["act"]["clip"] == act.clip


def test_unclipped_activations_keep_their_old_dict_and_name():
    assert "clip" not in W8A8.to_dict()["act"] and "-ac" not in W8A8.name
    assert parse_scheme("w4a4-ac90-g64").act.clip == pytest.approx(0.9)
    assert make_scheme(4, 64, act_bits=4, act_clip=0.9) == parse_scheme("w4a4-ac90-g64")


def test_searched_clip_name_dict_flags_and_refusals():
    scheme = parse_scheme("w4a4-aasym-acs-as1-g64-asym")
    assert scheme.act.clip_search and scheme.act.clip == 1.0 and scheme.act.clips
    assert scheme.name == "w4a4-aasym-acs-as1-g64-asym" and QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert scheme.to_dict()["act"]["clip_search"] is True and "clip_search" not in W8A8.to_dict()["act"]
    assert make_scheme(4, 64, True, act_bits=4, act_clip="search", act_symmetric=False, act_sinks=1) == \
        parse_scheme("w4a4-aasym-acs-as1-g64")
    assert scheme.act.clip_option == "search" and ActScheme(bits=4, clip=0.85).clip_option == "0.85"
    with pytest.raises(ConfigError, match="either one fraction"):
        ActScheme(bits=4, clip=0.9, clip_search=True)
    with pytest.raises(ConfigError, match="'search'"):
        make_scheme(4, 64, act_bits=4, act_clip="auto")
    with pytest.raises(ConfigError, match="--act-bits"):
        make_scheme(4, 64, act_clip="search")
    with pytest.raises(ConfigError, match="-acs"):
        parse_scheme("w4a16-acs-g64")
    with pytest.raises(ConfigError, match="dynamic"):
        ActScheme(clip_search=True, mode="static", granularity=PerTensor())


@pytest.mark.parametrize("clip", [0.0, -0.5, 1.2, float("nan")])
def test_activation_clip_outside_zero_one_is_refused(clip):
    with pytest.raises(ConfigError, match=r"clip ratio must lie in \(0, 1\]"):
        ActScheme(bits=4, clip=clip)


def test_sink_tokens_name_dict_and_refusals():
    scheme = parse_scheme("w4a4-aasym-ac90-as1-g64-asym")
    assert scheme.act.sinks == 1 and scheme.name == "w4a4-aasym-ac90-as1-g64-asym"
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme and "sinks" not in W8A8.to_dict()["act"]
    assert make_scheme(4, 64, act_bits=4, act_sinks=2).act.sinks == 2
    for kwargs in ({"sinks": -1}, {"sinks": 1.5}, {"sinks": True}):
        with pytest.raises(ConfigError, match="non-negative integer"):
            ActScheme(bits=4, **kwargs)
    with pytest.raises(ConfigError, match="--act-bits 4"):
        ActScheme(bits=8, sinks=1)
    with pytest.raises(ConfigError, match=r"--act-sinks.*--act-bits"):
        make_scheme(4, 64, act_sinks=1)
    with pytest.raises(ConfigError, match="-asN"):
        parse_scheme("w4a16-as1-g64")


def test_activation_groups_name_dict_flags_and_refusals():
    scheme = parse_scheme("w4a4-aasym-acs-as1-ag64-g64-asym")
    assert scheme.act.granularity == PerGroup(64) and scheme.act.group_size == 64
    assert scheme.name == "w4a4-aasym-acs-as1-ag64-g64-asym" and QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert make_scheme(4, 64, False, act_bits=4, act_clip="search", act_symmetric=False, act_sinks=1,
                       act_group_size=64) == scheme
    assert parse_scheme("w4a4-g64").act.group_size is None and W8A8.to_dict()["act"]["granularity"] == "token"
    for make, words in ((lambda: parse_scheme("w4a4-ag64-g128"), "--group-size 64"),
                        (lambda: make_scheme(4, None, act_bits=4, act_group_size=64), "one scale a row"),
                        (lambda: make_scheme(4, 64, act_group_size=64), "--act-group-size applies"),
                        (lambda: parse_scheme("w4a16-ag64-g64"), "-agN"),
                        (lambda: parse_scheme("w8a8-astatic-ag64-g64"), "one per tensor"),
                        (lambda: parse_scheme("w8a8-apt-ag64-g64"), "one per tensor"),
                        (lambda: make_scheme(8, 64, act_bits=8, act_mode="static", act_group_size=64),
                         "drop --act-group-size"),
                        (lambda: make_scheme(4, 64, act_bits=4, act_group_size=0), "positive integer"),
                        (lambda: ActScheme(bits=8, mode="online", granularity=PerGroup(64)), "per tensor")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            make()


def test_make_scheme_takes_asymmetric_activations():
    assert make_scheme(4, 64, act_bits=4, act_symmetric=False, act_clip=0.9) == parse_scheme("w4a4-aasym-ac90-g64")
    assert make_scheme(8, act_bits=8, act_mode="static", act_symmetric=False) == parse_scheme("w8a8-astatic-aasym")
    with pytest.raises(ConfigError, match=r"--act-asym.*--act-bits"):
        make_scheme(4, 64, act_symmetric=False)


def test_activation_clip_needs_dynamic_quantized_activations():
    with pytest.raises(ConfigError, match="dynamic"):
        ActScheme(clip=0.9, mode="static", granularity=PerTensor())
    with pytest.raises(ConfigError, match="--act-bits"):
        make_scheme(4, 64, act_clip=0.9)
    with pytest.raises(ConfigError, match="-acN"):
        parse_scheme("w4a16-ac90-g64")


@pytest.mark.parametrize("text", ["w8a16-apt", "w4a16-g64-aasym"])
def test_activation_options_without_activation_quantization(text):
    with pytest.raises(ConfigError, match="activation"):
        parse_scheme(text)


# make_scheme ----------------------------------------------------------------------------------------------------
def test_make_scheme_matches_cli_flags():
    assert make_scheme(4, 128, symmetric=False) == W4A16_G128
    assert make_scheme(8) == W8A16
    assert make_scheme(8, act_bits=8) == W8A8
    assert make_scheme(8, act_bits=16) == W8A16
    assert make_scheme(4, 128, act_bits=8) == W4A8_G128
    assert make_scheme(3, 32).granularity == PerGroup(32)
    assert make_scheme(3).granularity == PerChannel()


@pytest.mark.parametrize("scheme", [s for s in ALL_SCHEMES if not isinstance(s.granularity, PerTensor)],
                         ids=lambda s: s.name)  # make_scheme has no per-tensor flag
def test_make_scheme_agrees_with_parse(scheme):
    made = make_scheme(scheme.bits, scheme.group_size, scheme.symmetric, 8 if scheme.act else None)
    assert made == scheme


# dict round trip ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", [*ALL_SCHEMES, QuantScheme(8, act=ActScheme(granularity=PerTensor())),
                                    QuantScheme(8, act=ActScheme(symmetric=False))], ids=lambda s: s.name)
def test_dict_round_trip(scheme):
    data = scheme.to_dict()
    # Through JSON too: a checkpoint stores it as text.
    assert QuantScheme.from_dict(json.loads(json.dumps(data))) == scheme
    assert QuantScheme.from_dict(data) == scheme


def test_to_dict_content():
    assert W4A16_G128.to_dict() == {"bits": 4, "symmetric": False, "granularity": "group:128", "act": None}
    assert W8A8.to_dict() == {"bits": 8, "symmetric": True, "granularity": "channel",
                              "act": {"bits": 8, "symmetric": True, "dynamic": True, "granularity": "token"}}


@pytest.mark.parametrize("granularity", [PerTensor(), PerChannel(), PerToken(), PerGroup(1), PerGroup(128)])
def test_granularity_str_round_trip(granularity):
    assert granularity_from_str(granularity_to_str(granularity)) == granularity


def test_unknown_granularity_string():
    with pytest.raises(ConfigError, match="granularity"):
        granularity_from_str("row")


@pytest.mark.parametrize("mode, act", [
    (ActMode.DYNAMIC, {"dynamic": True, "granularity": "token"}),
    (ActMode.STATIC, {"dynamic": False, "granularity": "tensor"}),
    (ActMode.ONLINE, {"dynamic": False, "granularity": "tensor", "online": True, "momentum": 0.5, "eps": 1e-3,
                      "std_floor": True}),
])
def test_old_checkpoint_act_dicts_round_trip(mode, act):
    """Checkpoints store the activation mode as `dynamic` and `online` flags; those dicts load and are written back
    unchanged, key for key."""
    old = {"bits": 8, "symmetric": True, "granularity": "channel", "act": {"bits": 8, "symmetric": False, **act}}
    scheme = QuantScheme.from_dict(json.loads(json.dumps(old)))
    assert scheme.act.mode is mode
    assert scheme.to_dict() == old and json.dumps(scheme.to_dict()) == json.dumps(old)
    # Before the online mode, checkpoints held no `online` key at all; one saying `online: false` loads too.
    if mode is not ActMode.ONLINE:
        assert QuantScheme.from_dict(old | {"act": old["act"] | {"online": False}}) == scheme


def test_from_dict_rejects_bad_bits():
    data = W8A16.to_dict() | {"bits": 5}
    with pytest.raises(ConfigError, match="bit width"):
        QuantScheme.from_dict(data)


# presets --------------------------------------------------------------------------------------------------------
def test_presets():
    assert PRESETS == {"W8A16": W8A16, "W8A8": W8A8, "W4A16_G128": W4A16_G128, "W4A16_G64": W4A16_G64,
                       "W4A8_G128": W4A8_G128}
    assert W8A16.name == "w8a16" and W8A16.act is None and W8A16.granularity == PerChannel()
    assert W8A8.name == "w8a8" and W8A8.act == ActScheme()
    assert W4A16_G128.name == "w4a16-g128-asym"
    assert W4A16_G64.name == "w4a16-g64-asym"
    assert W4A8_G128.name == "w4a8-g128"
    for preset in PRESETS.values():
        assert parse_scheme(preset.name) == preset


def test_schemes_are_hashable_and_frozen():
    assert len({W8A16, QuantScheme(8), W8A8}) == 2
    with pytest.raises(AttributeError):
        W8A16.bits = 4  # type: ignore[misc]


# errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [0, 1, 5, 6, 7, 16, 32, -4])
def test_unsupported_weight_bits(bits):
    with pytest.raises(ConfigError, match="bit width") as info:
        QuantScheme(bits)
    assert str(bits) in str(info.value)
    assert "2, 3, 4, 8" in str(info.value)  # the message says what to choose instead
    with pytest.raises(ConfigError, match="bit width"):
        make_scheme(bits)


@pytest.mark.parametrize("text", ["w1a16", "w5a16", "w16a16", "w6a16-g64", "w32a8"])
def test_parse_unsupported_weight_bits(text):
    with pytest.raises(ConfigError, match="weight bit width"):
        parse_scheme(text)


@pytest.mark.parametrize("size", [0, -4, -128])
def test_group_size_not_positive(size):
    with pytest.raises(ConfigError, match="group size") as info:
        PerGroup(size)
    assert str(size) in str(info.value)
    with pytest.raises(ConfigError, match="group size"):
        make_scheme(4, group_size=size)


@pytest.mark.parametrize("size", [1.5, "64", True, None])
def test_group_size_not_integer(size):
    with pytest.raises(ConfigError, match="group size"):
        PerGroup(size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "w4a16-g0",
        "w4a16-g0-asym",
        "w4a16-g-4",
        "w4a16-g-128-asym",
    ],
)
def test_parse_group_size_not_positive(text):
    with pytest.raises(ConfigError, match="group size"):
        parse_scheme(text)


@pytest.mark.parametrize(
    "text",
    ["", "int4", "w4", "a16", "w4a16-g", "w4a16-gx", "w4a16-g64-foo", "4bit", "w4a16_g64", "w4a16--g64",
     "w4a16-g64-", "ww4a16", "w4a16 g64", "wxa16", "w8a8-pertoken"],
)
def test_unreadable_scheme_strings(text):
    with pytest.raises(ConfigError, match="cannot read scheme") as info:
        parse_scheme(text)
    assert repr(text) in str(info.value)
    assert "w4a16-g64" in str(info.value)  # the message shows an example of the right form


def test_per_token_weights_rejected():
    with pytest.raises(ConfigError, match="per token"):
        QuantScheme(8, granularity=PerToken())


@pytest.mark.parametrize("bits", [2, 3, 16, 1])
def test_activation_bits_other_than_8_or_4(bits):
    with pytest.raises(ConfigError, match="activation bit width") as info:
        ActScheme(bits=bits)
    assert str(bits) in str(info.value) and "choose 8 or 4" in str(info.value)


@pytest.mark.parametrize("text", ["w8a2", "w8a32", "w4a3-g64"])
def test_parse_activation_bits_other_than_8_or_4(text):
    with pytest.raises(ConfigError, match="activation bit width"):
        parse_scheme(text)


@pytest.mark.parametrize("act_bits", [2, 32])
def test_make_scheme_activation_bits_other_than_8_or_4(act_bits):
    with pytest.raises(ConfigError, match="activation bit width"):
        make_scheme(8, act_bits=act_bits)


@pytest.mark.parametrize("text", ["w4a4-g128", "w8a4", "w4a4-g64-asym"])
def test_four_bit_activations_round_trip(text):
    scheme = parse_scheme(text)
    assert scheme.act.bits == 4 and scheme.name == text
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme


def test_static_activations_rejected():
    with pytest.raises(ConfigError, match="static"):
        ActScheme(mode=ActMode.STATIC)


def test_act_mode_is_an_enum_that_prints_its_value():
    assert [str(m) for m in ActMode] == ["dynamic", "static", "online"]
    assert f"{ActMode.ONLINE}" == "online" and ActMode.STATIC == "static"
    assert ActScheme(mode="static", granularity=PerTensor()).mode is ActMode.STATIC  # strings are read as modes
    assert make_scheme(8, act_bits=8, act_mode="online").act.mode is ActMode.ONLINE
    with pytest.raises(ConfigError, match="unknown activation mode 'sometimes'; choose one of dynamic, static"):
        ActScheme(mode="sometimes", granularity=PerTensor())


def test_activation_granularity_must_be_per_token_per_group_or_per_tensor():
    with pytest.raises(ConfigError, match="per-token, per token in groups of channels, or per-tensor"):
        ActScheme(granularity=PerChannel())
    assert ActScheme(granularity=PerGroup(64)).group_size == 64


def test_config_error_is_value_error():
    # Callers that catch ValueError (argparse-style) still see it.
    with pytest.raises(ValueError):
        parse_scheme("nonsense")


# non-uniform 4-bit grids ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", ["nf4", "iq4nl", "learned"])
def test_grid_scheme_name_and_dict_round_trip(grid):
    scheme = QuantScheme(bits=4, granularity=PerGroup(64), grid=grid)
    assert scheme.name == f"w4a16-g64-{grid}"
    assert parse_scheme(scheme.name) == scheme
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert make_scheme(4, 64, grid=grid) == scheme


def test_checkpoint_without_grid_key_loads_uniform():
    data = QuantScheme(bits=4, granularity=PerGroup(64)).to_dict()
    assert "grid" not in data
    assert QuantScheme.from_dict(data).grid is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bits": 8}, "needs 4-bit weights"),
    ({"bits": 4, "symmetric": False}, "drop --asym"),
    ({"bits": 4, "act": ActScheme()}, "drop --act-bits"),
    ({"bits": 4, "granularity": PerTensor()}, "not per tensor"),
])
def test_grid_refuses_what_it_cannot_hold(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        QuantScheme(grid="nf4", **kwargs)


@pytest.mark.parametrize("bits", [3, 4])
def test_learned_grid_takes_three_or_four_bits(bits):
    scheme = parse_scheme(f"w{bits}a16-g64-learned")
    assert scheme.bits == bits and scheme.grid == "learned"
    assert QuantScheme.from_dict(scheme.to_dict()) == scheme


@pytest.mark.parametrize(("bits", "grid", "message"), [
    (2, "learned", "3- or 4-bit weights"), (8, "learned", "3- or 4-bit weights"),
    (3, "nf4", "needs 4-bit weights"), (3, "iq4nl", "needs 4-bit weights"),
])
def test_grid_bits_it_cannot_take(bits, grid, message):
    with pytest.raises(ConfigError, match=message):
        QuantScheme(bits=bits, granularity=PerGroup(64), grid=grid)


def test_unknown_grid_names_the_choices():
    with pytest.raises(ConfigError, match="nf4, iq4nl, learned"):
        QuantScheme(bits=4, grid="nf3")
    with pytest.raises(ConfigError, match="more than one grid"):
        parse_scheme("w4a16-g64-nf4-iq4nl")
