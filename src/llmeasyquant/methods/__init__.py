"""The methods a recipe is made of, by CLI name."""

from __future__ import annotations

import dataclasses

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import BlockContext, Method
from llmeasyquant.methods.gptq import GPTQ
from llmeasyquant.methods.rtn import RTN

METHODS: dict[str, type] = {"rtn": RTN, "gptq": GPTQ}


def method_by_name(name: str, **options: object) -> Method:
    """The method called `name`, built with `options` (each must be one of its fields)."""
    key = name.strip().lower()
    if key not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    cls = METHODS[key]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"method {key} has no option {', '.join(unknown)}; its options: {', '.join(sorted(fields))}")
    return cls(**options)


__all__ = ["GPTQ", "METHODS", "RTN", "BlockContext", "Method", "method_by_name"]
