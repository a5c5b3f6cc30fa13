"""Worker functions that the distributed tests start in separate processes (torch.multiprocessing, spawn).

Each worker joins a gloo group through the environment (as torchrun would set it), does one job on the tiny llama
and writes what it ended with to `out/rank{R}.*`, where the test reads it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

import llmeasyquant as lq
from conftest import build_model
from llmeasyquant.eval.perplexity import EvalWindows, evaluate_windows
from llmeasyquant.infra import distributed
from llmeasyquant.plan import Plan
from llmeasyquant.search.mixed_precision import Budget, MixedPrecisionSearch

# The configurations whose codes must be the same on 2 ranks as in one process (tests/infra/test_distributed.py).
CONFIGS = ("rtn", "gptq-sym", "gptq-asym", "gptq-sequential", "gptq-learned", "rotate-gptq", "gptaq", "awq",
           "smoothquant", "zeroquant", "mixed")
PLAN_FILE = "plan.json"  # the mixed-precision plan, searched by the test before the ranks start


def calib_ids() -> torch.Tensor:
    return torch.randint(3, 256, (16, 40), generator=torch.Generator().manual_seed(11))


def eval_windows() -> EvalWindows:
    ids = torch.randint(3, 256, (5, 32), generator=torch.Generator().manual_seed(12))
    return EvalWindows(ids, {"seqlen": 32})


def recipe(name: str) -> list:
    return {"rtn": [lq.RTN()], "gptq": [lq.GPTQ()], "gptq-sym": [lq.GPTQ()], "gptq-asym": [lq.GPTQ()],
            "awq": [lq.AWQ(), lq.RTN()], "mixed": [lq.GPTQ()],
            # alpha searched on the first 5 samples of all: 3 on rank 0, 2 on rank 1
            "smoothquant": [lq.SmoothQuant(alpha="auto", search_samples=5), lq.RTN()],
            # the layers solved on every rank (passes over the block after its first), not shared out
            "gptq-sequential": [lq.GPTQ(true_sequential=True)], "gptaq": [lq.GPTAQ()],
            "gptq-learned": [lq.GPTQ()], "rotate-gptq": [lq.Rotate(), lq.GPTQ()],
            "zeroquant": [lq.ZeroQuant(steps=3, samples=5)]}[name]


def scheme(name: str, folder: str | Path | None = None) -> lq.QuantScheme | Plan:
    if name == "mixed":
        return Plan.load(Path(folder, PLAN_FILE))
    schemes = {"smoothquant": "w8a8", "gptq-sym": "w4a16-g64", "zeroquant": "w4a8-g32",
               "gptq-learned": "w4a16-g32-learned", "rotate-gptq": "w4a16-g32"}
    return lq.parse_scheme(schemes.get(name, "w4a16-g32-asym"))


def search_plan() -> Plan:
    """A mixed-precision plan (2, 4 and 8 bits by layer) from the search, in one process (it does not run
    distributed); GPTQ then quantizes with it."""
    search = MixedPrecisionSearch(candidates=(2, 4, 8), group_size=32, method="rtn", probe_samples=1, probe_tokens=32)
    return search.run(build_model("llama"), calib_ids()[:4], Budget(avg_bits=4.5), progress=False).plan


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized model: codes, scales, zero points, and the float weights smoothing changed."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # tied ones apart


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model_state(model).items() if k.endswith(("qweight", "scales", "zeros"))}


def _join(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), LLMEASYQUANT_KERNEL_CHOICE="first")  # as the test process evaluates
    torch.set_num_threads(1)
    distributed.init("gloo", timeout_s)


def quantize_worker(rank: int, world: int, port: int, out: str, *methods: str) -> None:
    """Quantize with each of `methods` in turn; per method, the model's tensors and a JSON record (block reports and
    evaluation metrics) go to out/rank{R}-{method}.*"""
    _join(rank, world, port)
    try:
        for method in methods:
            model = lq.quantize(build_model("llama"), recipe(method), scheme(method, out), calib=calib_ids(),
                                progress=False)
            save_file(model_state(model), str(Path(out) / f"rank{rank}-{method}.safetensors"))
            reports = [{"error": r.output_rel_error, "sent": r.sent_bytes, "choices": r.choices}
                       for r in model.llmeasyquant.blocks]
            metrics = evaluate_windows({"model": model}, eval_windows(), progress=False)["model"]
            Path(out, f"rank{rank}-{method}.json").write_text(json.dumps({"blocks": reports, "metrics": metrics}))
    except lq.LLMEasyQuantError as exc:
        Path(out, f"rank{rank}.error").write_text(str(exc))
    finally:
        distributed.shutdown()


def evaluate_worker(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    try:
        model = build_model("llama")
        metrics = evaluate_windows({"model": model, "reference": build_model("gpt2")}, eval_windows(),
                                   reference="model", progress=False)
        Path(out, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        distributed.shutdown()


def dying_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 dies after joining; rank 0 must fail with a clear error instead of hanging or writing output."""
    _join(rank, world, port, timeout_s=20.0)
    if rank == 1:
        os._exit(3)
    try:
        model = lq.quantize(build_model("llama"), lq.GPTQ(), scheme("gptq"), calib=calib_ids(), progress=False)
        lq.save(model, Path(out) / "checkpoint")
    except lq.LLMEasyQuantError as exc:
        Path(out, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        distributed.shutdown()


def lonely_worker(rank: int, world: int, port: int, out: str) -> None:
    """Only rank 0 of 2 is started: the rendezvous must time out with a clear error."""
    os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        distributed.init("gloo", timeout_s=3.0)
    except lq.LLMEasyQuantError as exc:
        Path(out, "rank0.error").write_text(f"{type(exc).__name__}: {exc}")
