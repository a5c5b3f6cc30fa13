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


def start(worker, out: Path, *args: object, world: int = 2, timeout_s: float = 240) -> list[int]:
    """Run `worker` on `world` spawned ranks; wait for each (no rank is killed because another failed) and return
    their exit codes."""
    context = mp.start_processes(worker, args=(world, free_port(), str(out), *args), nprocs=world, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
    return [p.exitcode for p in context.processes]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every configuration of workers.CONFIGS quantized (and evaluated) on 2 ranks, one after another in one group."""
    out = tmp_path_factory.mktemp("ranks")
    workers.search_plan().save(out / workers.PLAN_FILE)
    assert start(workers.quantize_worker, out, *workers.CONFIGS, timeout_s=600) == [0, 0]  # one job after another
    return out


@pytest.mark.parametrize("config", workers.CONFIGS)
def test_two_ranks_agree_and_match_one_process(two_ranks: Path, config: str) -> None:
    """RTN, GPTQ (symmetric and asymmetric, act-order, true-sequential, a learned grid, after a rotation),
    GPTAQ, AWQ, SmoothQuant (alpha searched), ZeroQuant with distillation (on 5 samples: 3 on rank 0, 2 on rank 1)
    and a searched mixed-precision plan: every tensor of the quantized model is the same on both ranks (one thread
    each) and in one process (this one's threads)."""
    ranks = [load_file(two_ranks / f"rank{r}-{config}.safetensors") for r in range(2)]
    single = lq.quantize(build_model("llama"), workers.recipe(config), workers.scheme(config, two_ranks),
                         calib=workers.calib_ids(), progress=False)
    alone = workers.model_state(single)
    assert ranks[0].keys() == ranks[1].keys() == alone.keys()
    assert any(k.endswith("qweight") for k in alone)
    for key in alone:
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # every rank holds the same quantized weights
        assert torch.equal(ranks[0][key], alone[key]), key  # and they are the single process's, bit for bit
    record = json.loads((two_ranks / f"rank0-{config}.json").read_text())
    assert all(block["sent"] > 0 for block in record["blocks"])  # statistics, scales and codes really travelled
    # The block errors (exact sums) and what the methods chose (SmoothQuant's alpha) are the single process's too.
    assert [b["error"] for b in record["blocks"]] == [r.output_rel_error for r in single.llmeasyquant.blocks]
    assert [b["choices"] for b in record["blocks"]] == [r.choices for r in single.llmeasyquant.blocks]
    expected = evaluate_windows({"model": single}, workers.eval_windows(), progress=False)["model"]
    for metric in ("ppl", "nll", "tokens"):
        assert record["metrics"][metric] == expected[metric], metric


def test_the_mixed_plan_is_mixed(two_ranks: Path) -> None:
    bits = {rule["scheme"]["bits"] for rule in json.loads((two_ranks / workers.PLAN_FILE).read_text())["rules"]
            if rule["scheme"] is not None}
    assert len(bits) > 1, bits


def test_distributed_evaluation_equals_one_process(tmp_path: Path) -> None:
    assert start(workers.evaluate_worker, tmp_path) == [0, 0]
    expected = evaluate_windows({"model": build_model("llama"), "reference": build_model("gpt2")},
                                workers.eval_windows(), reference="model", progress=False)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in expected:
            for metric in ("ppl", "nll", "kld", "top1", "tokens"):
                assert got[name][metric] == expected[name][metric], (name, metric)  # exact sums: the same bits


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


def _first_difference(one: Path, other: Path) -> str | None:
    """The first tensor (in the checkpoint's order) whose bits differ between two saved checkpoints, or None."""
    a, b = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
            return f"{key}: {(a[key] != b[key]).sum().item()} of {a[key].numel()} values differ"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_two_ranks_write_the_single_process_checkpoint_of_the_bundled_model(tmp_path: Path, method: str) -> None:
    """Issue 59's commands on the real SmolLM2 and real calibration text: torchrun's two ranks (one thread each)
    write the checkpoint that one process (all its threads) writes, tensor by tensor."""
    quantize = ["quantize", "smollm2-135m", "--method", method, "--bits", "4", "--group-size", "64", "--calib",
                "wikitext2", "--calib-samples", "4", "--calib-seqlen", "256", "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    alone = subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", *quantize, "--out",
                            str(tmp_path / "one")], capture_output=True, text=True, env=env, timeout=600)
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "llmeasyquant.cli", "--quiet", *quantize, "--out", str(tmp_path / "two")],
                           capture_output=True, text=True, env=env, timeout=600)
    assert alone.returncode == 0 and ranks.returncode == 0, alone.stderr[-2000:] + ranks.stderr[-2000:]
    difference = _first_difference(tmp_path / "one", tmp_path / "two")
    assert difference is None, f"two ranks and one process part at {difference}"
