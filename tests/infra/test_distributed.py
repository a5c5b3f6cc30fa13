"""torch.distributed with 2 gloo ranks on this machine: ranks agree bit for bit, match the single process, exchange
scales, evaluate as one process would, and fail cleanly when a peer dies or never comes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import dist_workers as workers
import llmeasyquant as lq
from conftest import build_model
from llmeasyquant.eval.perplexity import evaluate_windows
from llmeasyquant.infra import distributed
from llmeasyquant.nn.qlinear import quantized_layers

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(worker, out: Path, *args: object, world: int = 2) -> list[int]:
    """Run `worker` on `world` spawned ranks; wait for each (no rank is killed because another failed) and return
    their exit codes."""
    context = mp.start_processes(worker, args=(world, free_port(), str(out), *args), nprocs=world, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(timeout=240)
        if process.is_alive():
            process.kill()
    return [p.exitcode for p in context.processes]


@pytest.mark.parametrize("method, min_identical", [("rtn", 1.0), ("gptq", 0.999), ("awq", 0.999),
                                                   ("smoothquant", 0.999)])
def test_two_ranks_agree_and_match_one_process(tmp_path: Path, method: str, min_identical: float) -> None:
    assert start(workers.quantize_worker, tmp_path, method) == [0, 0]
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for key in ranks[0]:  # the consistency guarantee: every rank holds the same quantized weights
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    single = lq.quantize(build_model("llama"), workers.recipe(method), workers.scheme(method),
                         calib=workers.calib_ids(), progress=False)
    alone = workers.quantized_state(single)
    codes = [k for k in alone if k.endswith("qweight")]
    same = sum(int((alone[k] == ranks[0][k]).sum()) for k in codes)
    total = sum(alone[k].numel() for k in codes)
    assert same / total >= min_identical, (method, same / total)
    if min_identical == 1.0:
        assert all(torch.equal(alone[k], ranks[0][k]) for k in alone)
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert all(block["sent"] > 0 for block in record["blocks"])  # scales and codes really travelled
    expected = evaluate_windows({"model": single}, workers.eval_windows(), progress=False)["model"]
    assert record["metrics"]["ppl"] == pytest.approx(expected["ppl"], rel=1e-3 if min_identical < 1 else 1e-6)


def test_distributed_evaluation_equals_one_process(tmp_path: Path) -> None:
    assert start(workers.evaluate_worker, tmp_path) == [0, 0]
    expected = evaluate_windows({"model": build_model("llama"), "reference": build_model("gpt2")},
                                workers.eval_windows(), reference="model", progress=False)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in expected:
            for metric in ("ppl", "nll", "kld", "top1", "tokens"):
                assert got[name][metric] == pytest.approx(expected[name][metric], rel=1e-6), (name, metric)


def test_distillation_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    start(workers.quantize_worker, tmp_path, "zeroquant")
    message = (tmp_path / "rank0.error").read_text()
    assert "distillation" in message and "--no-lkd" in message


def test_a_dead_rank_ends_the_run_without_output(tmp_path: Path) -> None:
    assert start(workers.dying_worker, tmp_path) == [0, 3]
    message = (tmp_path / "rank0.error").read_text()
    assert message.startswith("DistributedError") and "peer has died or timed out" in message
    assert not (tmp_path / "checkpoint").exists()


def test_a_rendezvous_that_times_out_is_a_clear_error(tmp_path: Path) -> None:
    start(workers.lonely_worker, tmp_path, world=1)
    message = (tmp_path / "rank0.error").read_text()
    assert message.startswith("DistributedError") and "rendezvous failed" in message and "--dist-timeout" in message


def test_balanced_assignment() -> None:
    owners = distributed.assign([8, 7, 6, 5, 4, 3, 2, 1], 2)
    loads = [sum(c for c, o in zip([8, 7, 6, 5, 4, 3, 2, 1], owners, strict=True) if o == r) for r in range(2)]
    assert loads == [18, 18]
    assert distributed.assign([1.0] * 5, 3) == distributed.assign([1.0] * 5, 3)  # deterministic
    assert not distributed.active() and distributed.shard(5) == [0, 1, 2, 3, 4]


def test_cli_under_torchrun(llama_folder: Path, wiki_text: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "llmeasyquant.cli", "--quiet", "quantize", str(llama_folder), "--method", "gptq", "--bits", "4",
               "--group-size", "32", "--calib", str(wiki_text), "--calib-samples", "4", "--calib-seqlen", "32",
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("saved ") == 1  # rank 0 alone reports (and writes)
    model, _ = lq.load(out)
    assert len(quantized_layers(model)) == 14
    evaluation = ["eval", str(out), "--text", str(wiki_text), "--seqlen", "32", "--max-windows", "5"]
    shared = subprocess.run([*command[:6], "-m", "llmeasyquant.cli", "--quiet", *evaluation], capture_output=True,
                            text=True, env=env, timeout=300)
    alone = subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", *evaluation], capture_output=True,
                           text=True, env=env, timeout=300)
    assert shared.returncode == 0 and alone.returncode == 0, shared.stderr[-2000:] + alone.stderr[-2000:]
    assert shared.stdout.startswith("ppl ") and shared.stdout.count("\n") == 1  # printed once, by rank 0
    assert shared.stdout == alone.stdout  # the same figures as one process
    code = subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--distributed", "compare"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert code.returncode == 2 and "does not run distributed" in code.stderr
