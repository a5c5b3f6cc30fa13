"""The methods a recipe is made of, by CLI name."""

from __future__ import annotations

from llmeasyquant.errors import ConfigError
from llmeasyquant.methods.base import BlockContext, Method
from llmeasyquant.methods.rtn import RTN

METHODS: dict[str, type] = {"rtn": RTN}


def method_by_name(name: str, **options: object) -> Method:
    key = name.strip().lower()
    if key not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(sorted(METHODS))}")
    return METHODS[key](**options)


__all__ = ["METHODS", "RTN", "BlockContext", "Method", "method_by_name"]
