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


def calib_ids() -> torch.Tensor:
    return torch.randint(3, 256, (6, 40), generator=torch.Generator().manual_seed(11))


def eval_windows() -> EvalWindows:
    ids = torch.randint(3, 256, (5, 32), generator=torch.Generator().manual_seed(12))
    return EvalWindows(ids, {"seqlen": 32})


def recipe(name: str) -> list:
    return {"rtn": [lq.RTN()], "gptq": [lq.GPTQ()], "awq": [lq.AWQ(), lq.RTN()],
            "smoothquant": [lq.SmoothQuant(alpha=0.5), lq.RTN()], "zeroquant": [lq.ZeroQuant(steps=2)]}[name]


def scheme(name: str) -> lq.QuantScheme:
    return lq.parse_scheme("w8a8" if name == "smoothquant" else "w4a16-g32-asym")


def quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.state_dict().items()
            if k.endswith(("qweight", "scales", "zeros"))}


def _join(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    distributed.init("gloo", timeout_s)


def quantize_worker(rank: int, world: int, port: int, out: str, method: str) -> None:
    _join(rank, world, port)
    try:
        model = lq.quantize(build_model("llama"), recipe(method), scheme(method), calib=calib_ids(), progress=False)
        save_file(quantized_state(model), str(Path(out) / f"rank{rank}.safetensors"))
        reports = [{"error": r.output_rel_error, "sent": r.sent_bytes} for r in model.llmeasyquant.blocks]
        metrics = evaluate_windows({"model": model}, eval_windows(), progress=False)["model"]
        Path(out, f"rank{rank}.json").write_text(json.dumps({"blocks": reports, "metrics": metrics}))
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
