"""The presets table: every entry names a recipe, a scheme and a KV cache that parse, and its options spell it."""

from __future__ import annotations

import pytest

from llmeasyquant.cli.options import _clip
from llmeasyquant.errors import ConfigError
from llmeasyquant.methods import recipe_by_name
from llmeasyquant.presets import QUANTIZE_PRESETS, preset
from llmeasyquant.scheme import make_scheme, parse_scheme


@pytest.mark.parametrize("name", ["w4a16-g64", "w3a16-g64", "w4a8-g64", "w4a4-kv4"])
def test_the_issue_presets_exist_and_parse(name):
    chosen = preset(name)
    assert recipe_by_name(chosen.method)
    scheme = parse_scheme(chosen.scheme)
    assert f"w{scheme.bits}a{scheme.act.bits if scheme.act else 16}" == name.split("-")[0]
    assert scheme.group_size == 64 if "g64" in name else True
    assert (chosen.kv_bits == 4) == name.endswith("kv4")
    if chosen.lm_head:
        assert parse_scheme(chosen.lm_head).act is None


def test_the_gguf_preset_is_on_llama_cpps_own_grid_and_exports():
    chosen = preset("w4a16-g32-gguf")
    scheme = parse_scheme(chosen.scheme)
    assert scheme.grid == "iq4nl" and scheme.group_size % 32 == 0 and not chosen.online_rotation
    assert "--grid iq4nl" in chosen.options


def test_options_spell_the_same_recipe():
    chosen = preset("w4a4-kv4")
    scheme = parse_scheme(chosen.scheme)
    words = chosen.options.split()
    assert words[words.index("--method") + 1] == chosen.method
    assert int(words[words.index("--bits") + 1]) == scheme.bits
    assert int(words[words.index("--act-bits") + 1]) == 4
    assert ("--asym" in words) == (not scheme.symmetric)
    assert words[words.index("--kv-bits") + 1] == "4"
    assert ("--online-rotation" in words) == chosen.online_rotation
    assert ("--online-attention-rotation" in words) == chosen.online_attention
    assert ("--act-asym" in words) == (not scheme.act.symmetric)
    assert ("--act-clip" in words) == scheme.act.clips
    assert ("--act-group-size" in words) == (scheme.act.group_size is not None)
    if scheme.act.clips:
        groups = int(words[words.index("--act-group-size") + 1]) if scheme.act.group_size else None
        assert parse_scheme(chosen.scheme) == make_scheme(scheme.bits, scheme.group_size, scheme.symmetric, 4,
                                                          act_clip=_clip(words[words.index("--act-clip") + 1]),
                                                          act_symmetric=scheme.act.symmetric,
                                                          act_sinks=scheme.act.sinks, act_group_size=groups)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'w5'") as info:
        preset("w5")
    assert all(name in str(info.value) for name in QUANTIZE_PRESETS)
