"""torch.distributed (c10d) for quantization and evaluation: NCCL when every rank has a GPU, gloo (TCP) otherwise.

Launch the usual command under `torchrun --nproc_per_node N` (or pass `--distributed`); `init()` reads the rank,
world size and rendezvous address that torchrun sets. Then:
- calibration batches are shared out (`shard`), and the statistics computed from them are summed (`all_reduce`)
  so every rank holds the statistics of all the data;
- within a block the layer solves are shared out by cost (`assign`), and each quantized layer is broadcast from the
  rank that solved it (`broadcast_layer`), so every rank holds the same quantized block before the next one;
- evaluation windows are shared out and the sums behind each metric are all-reduced;
- rank 0 writes outputs (`is_writer`).
Nothing here is active in a single process: every helper is then the identity.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmeasyquant.errors import ConfigError, LLMEasyQuantError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class DistributedError(LLMEasyQuantError):
    """A rank that died, a rendezvous that timed out, or a collective that failed."""


@dataclass
class _State:
    rank: int
    world: int
    backend: str
    sent_bytes: int = 0  # bytes this rank put into collectives (a measure of communication volume)


_STATE: _State | None = None


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Join the process group torchrun (or the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) describes."""
    global _STATE
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(f"--distributed needs {', '.join(missing)} in the environment: launch with "
                          "torchrun --nproc_per_node N llmeasyquant ...")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("the nccl backend needs a GPU on every rank; use --backend gloo")
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, TimeoutError) as exc:
        raise DistributedError(f"rendezvous failed ({' '.join(str(exc).split())[:200]}); check that every rank was "
                               f"started and can reach {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, or "
                               "raise --dist-timeout") from exc
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _STATE = _State(dist.get_rank(), dist.get_world_size(), backend)
    log.info("rank %d of %d joined (%s)", _STATE.rank, _STATE.world, backend)


def shutdown() -> None:
    global _STATE
    if _STATE is not None and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None


def active() -> bool:
    return _STATE is not None


def rank() -> int:
    return _STATE.rank if _STATE else 0


def world() -> int:
    return _STATE.world if _STATE else 1


def is_writer() -> bool:
    """Only rank 0 writes checkpoints, plans and records."""
    return rank() == 0


def sent_bytes() -> int:
    return _STATE.sent_bytes if _STATE else 0


def _collective(what: str, call) -> None:
    try:
        call()
    except (RuntimeError, TimeoutError) as exc:
        raise DistributedError(f"rank {rank()}: {what} failed, a peer has died or timed out "
                               f"({' '.join(str(exc).split())[:200]}); no output was written") from exc


def _device_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cuda() if _STATE and _STATE.backend == "nccl" and not tensor.is_cuda else tensor


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The elementwise sum (or min, max) of `tensor` over all ranks, returned (the input is left as it was)."""
    if not active():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    work = _device_tensor(tensor.detach().clone())
    _STATE.sent_bytes += work.numel() * work.element_size()
    _collective(f"all_reduce of {tuple(work.shape)}", lambda: dist.all_reduce(work, op=ops[op]))
    return work.to(tensor.device)


def broadcast_(tensor: torch.Tensor, src: int) -> None:
    """Overwrite `tensor` on every rank with rank `src`'s."""
    if not active():
        return
    work = _device_tensor(tensor)
    if rank() == src:
        _STATE.sent_bytes += work.numel() * work.element_size()
    _collective(f"broadcast of {tuple(work.shape)} from rank {src}", lambda: dist.broadcast(work, src=src))
    if work is not tensor:
        tensor.copy_(work)


def barrier() -> None:
    if active():
        _collective("barrier", dist.barrier)


def shard(count: int) -> list[int]:
    """The indices of `count` items (calibration batches, evaluation windows) this rank processes."""
    return list(range(rank(), count, world()))


def gather_dealt(mine: Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The first `count` items of a list that `shard` dealt out, on every rank, in the list's order: each
    broadcast from the rank that holds it (`mine`: this rank's items, in `shard`'s order). Every item has the
    shape and dtype of this rank's first; alone, `mine[:count]`."""
    if not active():
        return list(mine[:count])
    items = []
    for index in range(count):
        owner, position = index % world(), index // world()
        item = mine[position].clone() if owner == rank() else torch.empty_like(mine[0])
        broadcast_(item, owner)
        items.append(item)
    return items


def assign(costs: Sequence[float], ranks: int) -> list[int]:
    """A balanced owner rank per item: longest job first onto the least loaded rank (deterministic)."""
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(ranks), key=lambda r: (load[r], r))
        owner[item] = target
        load[target] += costs[item]
    return owner
