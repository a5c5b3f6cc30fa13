"""The methods a recipe is made of, by CLI name, and recipes written as names (`smoothquant+gptq`)."""

from __future__ import annotations

import dataclasses

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.awq import AWQ
from llmeasyquant.methods.base import BlockContext, CacheMethod, Method, ModelTransform, Quantizer, Step, Transform
from llmeasyquant.methods.gptaq import GPTAQ
from llmeasyquant.methods.gptq import GPTQ
from llmeasyquant.methods.rotate import Rotate
from llmeasyquant.methods.rtn import RTN
from llmeasyquant.methods.smoothquant import SmoothQuant
from llmeasyquant.methods.zeroquant import ZeroQuant

METHODS: dict[str, type[Method]] = {"rtn": RTN, "gptq": GPTQ, "gptaq": GPTAQ, "smoothquant": SmoothQuant,
                                  "awq": AWQ, "zeroquant": ZeroQuant, "rotate": Rotate}


def _method_class(name: str) -> type[Method]:
    key = name.strip().lower()
    if key not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    return METHODS[key]


def method_by_name(name: str, **options: object) -> Method:
    """The method called `name`, built with `options` (each must be one of its fields)."""
    cls = _method_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"method {cls.name} has no option {', '.join(unknown)}; "
                          f"its options: {', '.join(sorted(fields)) or 'none'}")
    return cls(**options)


def recipe_by_name(spec: str, strict: bool = True, **options: object) -> list[Method]:
    """`rtn`, `gptq`, `smoothquant` (then RTN), `smoothquant+gptq`: each option goes to the method that has it.

    An option no method of the recipe has is an error, unless `strict` is False (options shared by several
    recipes, e.g. when comparing methods, each recipe taking those it knows)."""
    classes = [_method_class(part) for part in spec.split("+") if part.strip()]
    if not classes:
        raise ConfigError("no method named; use e.g. --method rtn")
    if issubclass(classes[-1], Transform):
        classes.append(RTN)  # a transform alone is followed by round to nearest
    taken: set[str] = set()
    recipe = []
    for cls in classes:
        mine = {k: v for k, v in options.items() if k in {f.name for f in dataclasses.fields(cls)}}
        taken |= set(mine)
        recipe.append(cls(**mine))
    unknown = sorted(set(options) - taken)
    if unknown and strict:
        raise ConfigError(f"no method of {spec!r} has the option {', '.join(unknown)}")
    return recipe


__all__ = ["AWQ", "GPTAQ", "GPTQ", "METHODS", "RTN", "BlockContext", "CacheMethod", "Method", "ModelTransform",
           "Quantizer", "Rotate", "SmoothQuant", "Step", "Transform", "ZeroQuant", "method_by_name", "recipe_by_name"]
