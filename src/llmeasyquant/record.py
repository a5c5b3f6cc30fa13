"""Result records: one typed shape for eval, bench, quantize, compare, search, export and the benchmarks, made,
written and read here only.

A `Record` is what was measured (`metrics`), how (`protocol`), on which model, by which command line, with what
software (`versions`) on which machine. On disk it is JSON, one record as an object or several as a list:

    {"kind": "compare", "model": "smollm2-135m", "metrics": {...}, "protocol": {...}, "command": "llmeasyquant ...",
     "versions": {"llmeasyquant": ..., "torch": ..., ...}, "machine": {"platform": ..., "cpus": ..., ...},
     "schema_version": 1}

`metrics` and `protocol` are open dicts: each kind fills its own (docs/compare_record.md lists compare's). The
scheme and the recipe are not fields of their own: a row's scheme is one of its metrics (`metrics["scheme"]`, a
table column, and bench or search records have none) and the recipe, like a plan, is part of the protocol
(`protocol["recipe"]`: how the numbers were made). Files written before `schema_version` existed hold the same
shape without it and load as version 1.

The command line a record names is passed in by whoever makes it (the CLI passes the `llmeasyquant ...` line it
ran, down to the jobs); without one, a record names this process's own command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from llmeasyquant.errors import DataError
from llmeasyquant.infra.files import write_atomic

SCHEMA_VERSION = 1  # the shape of Record.to_dict(); files without the field are version 1

# What a row's quality numbers (perplexity, KL, top-1) were measured on: rows differing in any of these measured
# different things and must not be compared. (The report's table used to leave out bos, though a prepended BOS token
# changes every perplexity; the figures' captions added threads, which only speed depends on: see
# report/style.protocol_caption, which names differing threads beside these, and report/html.py, which groups rows by
# machine, threads and versions apart from what they were measured on.)
PROTOCOL_KEYS = ("text_sha256", "seqlen", "windows", "bos")

_REQUIRED = {"kind": str, "model": str, "metrics": dict, "protocol": dict, "command": (str, type(None)),
             "versions": dict, "machine": dict}


def versions() -> dict[str, str]:
    import transformers

    from llmeasyquant.version import __version__

    return {"llmeasyquant": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


# What narrows the instruction sets a run uses below the CPU's (a session on an AVX-512 machine measures the AVX2
# class this way: PyTorch's kernels and our native build follow ATEN_CPU_CAPABILITY, oneDNN and MKL their own).
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine() -> dict:
    """The machine a record ran on, with the instruction-set class its kernels used (PyTorch's CPU capability,
    which names our native build too) and any override of it."""
    found = {"platform": platform.platform(), "processor": platform.machine(), "cpu": cpu_model(),
             "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
             "isa": torch.backends.cpu.get_cpu_capability()}
    overrides = {name: os.environ[name] for name in ISA_OVERRIDES if os.environ.get(name)}
    if overrides:
        found["isa_overrides"] = overrides
    return found


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ...", "AMD EPYC ..."): speeds, and the last bits of float
    reductions, differ between machines of the same architecture, so a figure names the model it ran on. Where
    Linux's cpuinfo is missing, what `platform` knows (often empty)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor()


def this_command() -> str:
    """This process's command line, as a record names it when no command is passed in. Absolute paths are written
    relative to the working folder when inside it, else by their last name: a record names its inputs and outputs,
    not the folders of the machine that made it."""
    return " ".join([Path(sys.argv[0]).name, *map(portable_argument, sys.argv[1:])])


def portable_argument(argument: str) -> str:
    """One command-line word as a record writes it (see `this_command`)."""
    option, equals, value = argument.rpartition("=") if argument.startswith("--") else ("", "", argument)
    if not value.startswith("/"):
        return argument
    path = Path(value)
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = path.name or value
    return f"{option}{equals}{shown}"


@dataclasses.dataclass(frozen=True)
class Record:
    """One result. Frozen: the fields are not reassigned (`dataclasses.replace` makes a changed copy), though the
    dicts they hold stay dicts. Make a new measurement's record with `Record.new`, which fills in the command line,
    versions and machine; read one with `Record.from_dict` or `read_records`."""

    kind: str  # compare, eval, quantize, bench, search, export, or a benchmark's own
    model: str  # the model spec or checkpoint measured
    metrics: dict  # what was measured: read with .metric(name)
    protocol: dict  # how: text and its sha256, windows, seqlen, bos, threads, seed, recipe, calibration ...
    command: str | None = None  # the command line that produced it
    versions: dict = dataclasses.field(default_factory=dict)  # llmeasyquant, torch, transformers, python
    machine: dict = dataclasses.field(default_factory=dict)  # platform, processor, cpus, threads
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def new(cls, kind: str, model: str, metrics: dict, protocol: dict, command: str | None = None) -> Record:
        """The record of a measurement made now: this software's versions and this machine, and `command` (default:
        this process's command line)."""
        return cls(kind, model, metrics, protocol, command if command is not None else this_command(), versions(),
                   machine())

    def metric(self, name: str, default: Any = None) -> Any:
        """One metric, `default` when the record does not hold it."""
        return self.metrics.get(name, default)

    def measured_on(self) -> tuple:
        """The values of PROTOCOL_KEYS (None where not recorded): rows with equal tuples measured alike."""
        return tuple(self.protocol.get(k) for k in PROTOCOL_KEYS)

    def to_dict(self) -> dict:
        """The JSON shape: the seven fields records always had, then schema_version."""
        return {"kind": self.kind, "model": self.model, "metrics": self.metrics, "protocol": self.protocol,
                "command": self.command, "versions": self.versions, "machine": self.machine,
                "schema_version": self.schema_version}

    @classmethod
    def from_dict(cls, data: object, source: str | Path = "record") -> Record:
        """A record from its JSON shape; `source` (the file, and the item in it) names it in errors. Every field but
        schema_version must be there with its type; a newer schema_version than this version writes is refused."""
        if not isinstance(data, dict):
            raise DataError(f"{source}: a record is a JSON object, not {type(data).__name__}")
        for name, types in _REQUIRED.items():
            if name not in data:
                raise DataError(f"{source}: the record has no {name!r} field (a record has {', '.join(_REQUIRED)})")
            if not isinstance(data[name], types):
                raise DataError(f"{source}: the record's {name!r} is a {type(data[name]).__name__}, not "
                                f"{_type_name(types)}")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DataError(f"{source}: the record's 'schema_version' is {version!r}, not a version number")
        if version > SCHEMA_VERSION:
            raise DataError(f"{source}: record schema_version {version} was written by a newer llmeasyquant (this one "
                            f"reads up to {SCHEMA_VERSION}); upgrade llmeasyquant")
        unknown = sorted(set(data) - set(_REQUIRED) - {"schema_version"})
        if unknown:
            raise DataError(f"{source}: the record has unknown field(s) {', '.join(map(repr, unknown))}")
        return cls(data["kind"], data["model"], data["metrics"], data["protocol"], data["command"], data["versions"],
                   data["machine"], version)


def _type_name(types: type | tuple[type, ...]) -> str:
    names = {str: "a string", dict: "an object", type(None): "null"}
    return " or ".join(names[t] for t in (types if isinstance(types, tuple) else (types,)))


def write_records(path: str | Path, records: Record | Sequence[Record]) -> Path:
    """Write one record (a JSON object) or several (a list) atomically: a temporary file, then a rename."""
    data = records.to_dict() if isinstance(records, Record) else [r.to_dict() for r in records]
    return write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def load_json(path: str | Path) -> object:
    """A JSON file's content; a missing file, or one that is not UTF-8 JSON, is a DataError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from exc


def items_of(path: str | Path, data: object) -> list[tuple[str, object]]:
    """(name in errors, item) for each item of a file's content: the file itself for one object, else the file and
    the item's index."""
    if isinstance(data, list):
        return [(f"{path}, item {i}", item) for i, item in enumerate(data)]
    return [(str(path), data)]


def read_records(path: str | Path) -> list[Record]:
    """The records a file holds (one object or a list), every one checked by Record.from_dict."""
    return [Record.from_dict(item, source) for source, item in items_of(path, load_json(path))]
