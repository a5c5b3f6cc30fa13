"""The result record: its JSON shape, old files without schema_version, clear errors for malformed ones, and every
record file under benchmarks/results loading through Record.from_dict."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from llmeasyquant import record
from llmeasyquant.errors import DataError
from llmeasyquant.plan import Plan
from llmeasyquant.record import PROTOCOL_KEYS, SCHEMA_VERSION, Record, read_records, this_command, write_records

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
OLD = {"kind": "eval", "model": "m", "metrics": {"ppl": 12.5}, "protocol": {"seqlen": 32, "bos": False},
       "command": "llmeasyquant eval m", "versions": {"torch": "2.0"}, "machine": {"cpus": 4}}


def test_to_dict_keeps_the_old_keys_in_order_and_adds_schema_version() -> None:
    rec = Record.from_dict(OLD)
    assert list(rec.to_dict()) == [*OLD, "schema_version"]
    assert rec.to_dict() == OLD | {"schema_version": SCHEMA_VERSION}
    assert Record.from_dict(rec.to_dict()) == rec
    assert rec.metric("ppl") == 12.5 and rec.metric("kld") is None and rec.metric("kld", 0.0) == 0.0


def test_record_is_frozen_but_its_dicts_are_not() -> None:
    rec = Record.from_dict(OLD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.model = "other"  # type: ignore[misc]
    rec.metrics["kld"] = 0.1
    assert rec.metric("kld") == 0.1


@pytest.mark.parametrize("missing", ["kind", "model", "metrics", "protocol", "command", "versions", "machine"])
def test_a_missing_field_is_named(missing: str) -> None:
    data = {k: v for k, v in OLD.items() if k != missing}
    with pytest.raises(DataError, match=f"results.json, item 2: the record has no '{missing}' field"):
        Record.from_dict(data, "results.json, item 2")


@pytest.mark.parametrize(("change", "needle"), [
    ({"metrics": [1, 2]}, "'metrics' is a list, not an object"),
    ({"model": None}, "'model' is a NoneType, not a string"),
    ({"schema_version": "1"}, "'schema_version' is '1'"),
    ({"schema_version": SCHEMA_VERSION + 1}, "newer llmeasyquant"),
    ({"extra": 1}, "unknown field(s) 'extra'"),
])
def test_malformed_records_fail_clearly(change: dict, needle: str) -> None:
    with pytest.raises(DataError, match=f"^r.json: .*{needle.replace('(', '.').replace(')', '.')}"):
        Record.from_dict(OLD | change, "r.json")
    with pytest.raises(DataError, match="a record is a JSON object, not list"):
        Record.from_dict([OLD], "r.json")


def test_read_records_names_the_file_and_the_item(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([OLD, {k: v for k, v in OLD.items() if k != "protocol"}]))
    with pytest.raises(DataError, match=f"{path}, item 1: the record has no 'protocol' field"):
        read_records(path)
    path.write_text(json.dumps(OLD))
    assert read_records(path) == [Record.from_dict(OLD)]
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.json")
    path.write_text("{oops")
    with pytest.raises(DataError, match="not valid JSON"):
        read_records(path)


def test_write_then_read(tmp_path: Path) -> None:
    records = [Record.new("compare", "m", {"ppl": 1.5}, {"seqlen": 8}, command="c"), Record.from_dict(OLD)]
    path = write_records(tmp_path / "out.json", records)
    assert read_records(path) == records
    assert json.loads(path.read_text())[1]["schema_version"] == SCHEMA_VERSION
    write_records(path, records[1])
    assert isinstance(json.loads(path.read_text()), dict) and read_records(path) == records[1:]


def test_measured_on_reads_the_protocol_keys() -> None:
    rec = Record.from_dict(OLD)
    assert PROTOCOL_KEYS[:3] == ("text_sha256", "seqlen", "windows")
    assert rec.measured_on() == tuple(OLD["protocol"].get(k) for k in PROTOCOL_KEYS)


def _result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_there_are_result_files() -> None:
    assert len(_result_files()) > 10


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_every_benchmark_result_loads(path: Path) -> None:
    """Each record file under benchmarks/results (written before schema_version existed) loads and writes back
    the same keys; the plan files there are plans (Plan.load), not records."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "rules" in data:
        assert path.name.startswith("plan_")
        assert Plan.load(path).rules
        return
    records = read_records(path)
    assert records and all(isinstance(r, Record) and r.kind and r.versions for r in records)
    items = data if isinstance(data, list) else [data]
    assert [r.to_dict() for r in records] == [item | {"schema_version": 1} for item in items]


def test_a_records_command_names_paths_without_this_machines_folders(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    inside, outside = tmp_path / "results" / "run.json", "/opt/tools/build/bin"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/bench.py", "--out", str(inside), f"--tools={outside}", "--seed", "3",
                                      "-"])
    assert this_command() == "bench.py --out results/run.json --tools=bin --seed 3 -"
    assert "/" not in this_command().replace("results/run.json", "")


def test_the_machine_names_its_cpu_model(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    assert record.cpu_model(info) == "AMD EPYC 9R14 96-Core Processor"
    assert record.cpu_model(tmp_path / "missing") == record.platform.processor()
    assert "cpu" in record.machine()


def test_the_machine_names_the_instruction_set_class_and_its_overrides(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    found = record.machine()
    assert found["isa"] == record.torch.backends.cpu.get_cpu_capability()
    assert "isa_overrides" not in found
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert record.machine()["isa_overrides"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
