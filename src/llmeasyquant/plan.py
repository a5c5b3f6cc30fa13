"""Plan: ordered (pattern -> scheme | skip) rules; the first rule that matches a module's name wins.

Linear layers inside the transformer blocks are matched by every rule, but for those the architecture keeps float
(a mixture of experts' router and gates). Layers outside them (the LM head) are
quantized only when a rule names them, i.e. its pattern contains the module's name; embeddings never are.
Mixed precision is nothing but a plan with one rule per layer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from llmeasyquant.errors import ConfigError
from llmeasyquant.models.arch import arch_for, is_linear
from llmeasyquant.scheme import QuantScheme


@dataclass(frozen=True)
class Rule:
    pattern: str  # regular expression, matched against the whole dotted module name
    scheme: QuantScheme | None  # None: leave the module unquantized

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ConfigError(f"plan pattern {self.pattern!r} is not a valid regular expression: {exc}") from exc

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class Plan:
    rules: tuple[Rule, ...]

    @classmethod
    def uniform(cls, scheme: QuantScheme) -> Plan:
        return cls((Rule(".*", scheme),))

    def resolve(self, model: nn.Module) -> dict[str, QuantScheme]:
        """{module name: scheme} for every linear layer the plan quantizes, in model order."""
        arch = arch_for(model)
        blocks_prefix = arch.blocks + "."
        resolved: dict[str, QuantScheme] = {}
        for name, module in model.named_modules():
            if not is_linear(module):
                continue
            inside = name.startswith(blocks_prefix)
            if inside and name[len(blocks_prefix):].partition(".")[2] in arch.float_layers:
                continue  # a router or gate the family keeps float (models/arch.py: float_layers)
            for rule in self.rules:
                if rule.matches(name) and (inside or name in rule.pattern):
                    if rule.scheme is not None:
                        resolved[name] = rule.scheme
                    break
        return resolved

    def to_dict(self) -> dict:
        return {"rules": [{"pattern": r.pattern, "scheme": None if r.scheme is None else r.scheme.to_dict()}
                          for r in self.rules]}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        try:
            return cls(tuple(Rule(r["pattern"], None if r["scheme"] is None else QuantScheme.from_dict(r["scheme"]))
                             for r in data["rules"]))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"plan is malformed ({exc!r}); expected {{'rules': [{{'pattern', 'scheme'}}]}}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"plan file {path} does not exist")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"plan file {path} is not valid JSON: {exc}") from exc
