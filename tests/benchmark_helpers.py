"""Loading a script of benchmarks/ in tests, as the command line runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from llmeasyquant.record import read_records

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module. Its folder goes on sys.path first (for the scripts that import their
    neighbours, as `python benchmarks/NAME.py` allows) and stays there: the names are the benchmarks' own."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module


def run_ab_benchmark(module: ModuleType, checkpoint: Path, out: Path, sides: tuple[str, str]) -> tuple[str, dict]:
    """Run a same-process A/B benchmark (benchmarks/same_process_ab.py) for 2 short rounds on one thread; check what
    every such run must hold (both sides timed each round, the speedup their medians' ratio, the thread count given
    back, no path of this machine in the record); its record's kind and metrics."""
    threads = torch.get_num_threads()
    assert module.main([str(checkpoint), "--rounds", "2", "--threads", "1", "--prompt-tokens", "8",
                        "--new-tokens", "3", "--out", str(out)]) == 0
    [record] = read_records(out)
    metrics = record.metrics
    assert record.model == checkpoint.name
    assert [sorted(r["order"]) for r in metrics["rounds"]] == [sorted(sides)] * 2
    assert all(r[side] > 0 for r in metrics["rounds"] for side in sides)
    assert metrics["speedup"] == pytest.approx(metrics[f"tok_s_{sides[0]}"] / metrics[f"tok_s_{sides[1]}"])
    assert 0 <= metrics["rounds_won"] <= 2
    assert str(checkpoint.parent) not in out.read_text()  # the command names the checkpoint, not where it lies
    assert torch.get_num_threads() == threads  # --threads is the run's, not the process's afterwards
    return record.kind, metrics
