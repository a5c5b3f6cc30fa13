"""Decode speed at real sizes: a synthetic checkpoint (benchmarks/make_synthetic.py) quantized W8A16, W8A8,
W4A16 g128 and W4A8 g128 with the LM head quantized, against the machine's bandwidth bound and against llama.cpp
on the same weights exported to GGUF, in one run.

    python benchmarks/scale_speed.py DIR --work SCRATCH [--llama-bench PATH] [--threads 2] [--repeats 3]
        [--prompt-tokens 32] [--new-tokens 16] [--timeout 1800] [--keep] [--out benchmarks/results/scale_speed.json]

1. The GGUF files llama.cpp runs beside the schemes asked for (each step a child process with a timeout): RTN at
   g32, whose codes GGUF holds exactly (symmetric 8-bit -> Q8_0, symmetric 4-bit -> Q4_0, asymmetric 4-bit ->
   Q4_1, the head in the same scheme), `llmeasyquant quantize DIR --method rtn ... --stream`, then
   `llmeasyquant export --to gguf --no-check`; each g32 checkpoint is deleted once exported.
2. Per scheme of ours, in turn (one checkpoint on disk and in memory at a time): quantize it
   (`llmeasyquant quantize DIR --method rtn ... --lm-head HEAD --stream`: each with the head in its own scheme,
   W8A16, W8A8, W4A16 g128 or W4A8 g128), load it
   (export/checkpoint.load, as `bench` does), fuse q/k/v and gate/up and move the weights onto 2 MiB pages (as
   `bench` does; records before 2026-11-28 01:07 UTC, without `huge_page_bytes`, ran on 4 KiB pages), then
   `--repeats` rounds, each: the machine's read bandwidth (eval/bench.py), our greedy decode on the lean loop (a
   `--prompt-tokens` prompt of seeded random ids, then `--new-tokens` tokens; tokens/s over the steps after the
   first), then one
   `llama-bench -p 0 -n NEW -r 1` per GGUF of the same bits (Q8_0 beside W8A16 and W8A8; Q4_0 and Q4_1 beside
   W4A16 and W4A8). Medians over rounds. The load average and available memory are recorded with every
   measurement (the machine is shared). Its record is written (merged into --out by model and scheme) and its
   checkpoint deleted before the next scheme starts.
   Outputs already in --work are reused; --keep keeps them all.
3. Bytes per decoded token: every weight a step reads once (codes, scales, zero points, norms, the quantized LM
   head; one row of the embedding table, not counted), from the checkpoint as stored
   (`eval/bench.weight_bytes_per_token`) and as the chosen decode kernels hold it after preparing it
   (`kernel_bytes_per_token`: a kernel may repack, e.g. int4 codes with bf16 scale-and-offset pairs). The bound
   is bandwidth / stored bytes: the format's speed of light. For llama.cpp, the GGUF's tensors other than token_embd.

llama-bench is llama.cpp's own tool (build it with CMake from the llama.cpp sources, e.g. those inside the
llama-cpp-python source package: `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-bench`);
without --llama-bench (or when the path does not run) the llama.cpp rows are skipped and the record says why.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path

import torch
from torch import nn

from llmeasyquant.eval.bench import memory_bandwidth_gbs, weight_bytes_per_token
from llmeasyquant.eval.speed import timed_greedy
from llmeasyquant.infra.memory import release_freed_memory
from llmeasyquant.record import Record, read_records, write_records

# name: (quantize flags, LM head scheme); the head takes the body's scheme, with dynamic int8 activations where the
# body has them, as llama.cpp's Q8_0 and Q4_0 files run their output tensor (records before 2026-11-27 13:00 UTC
# ran W8A8's head W8A16 and W4A8's W4A16 g128: each record's protocol names its head).
OURS = {
    "w8a16": (["--bits", "8"], "w8a16"),
    "w8a8": (["--bits", "8", "--act-bits", "8"], "w8a8"),
    "w4a16-g128": (["--bits", "4", "--group-size", "128"], "w4a16-g128"),
    # int8 activations and integer dot products, as llama.cpp's Q4_0 x Q8_0 dot product does (its activations in
    # blocks of 32, ours per token)
    "w4a8-g128": (["--bits", "4", "--group-size", "128", "--act-bits", "8"], "w4a8-g128"),
}
# GGUF type: (flags of the RTN g32 checkpoint whose codes it holds exactly, head scheme, our schemes it runs beside)
PEERS = {
    "Q8_0": (["--bits", "8", "--group-size", "32"], "w8a16-g32", ("w8a16", "w8a8")),
    "Q4_0": (["--bits", "4", "--group-size", "32"], "w4a16-g32", ("w4a16-g128", "w4a8-g128")),
    "Q4_1": (["--bits", "4", "--group-size", "32", "--asym"], "w4a16-g32-asym", ("w4a16-g128", "w4a8-g128")),
}


# Kernels whose prepared object holds the codes repacked (they do not read layer.qweight).
REPACKING_KERNELS = ("cpu_int4pack_w4a16",)


class Timeout(Exception):
    """A measurement ran past --timeout."""


def conditions() -> dict:
    """The load average and available memory now: the machine is shared, so every figure carries them."""
    available = None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024 / 1e9
    return {"loadavg": [round(v, 2) for v in os.getloadavg()], "mem_available_gb": available}


def machine() -> dict:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    total = None
    if Path("/proc/meminfo").is_file():
        total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / 1e9
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_total_gb": total, "isa": isa()}


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_int8", "amx_tile")


def isa() -> list[str]:
    """The instruction sets among ISA_FLAGS that this CPU reports (/proc/cpuinfo's flags)."""
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.is_file() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in ISA_FLAGS if flag in flags]


def run_child(command: list[str], log: Path, timeout: float) -> dict:
    """Run `command` with its output in `log`, killed past `timeout` seconds; exit code and wall seconds."""
    start = time.perf_counter()
    with log.open("w") as sink:
        try:
            code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"exit": code, "wall_s": time.perf_counter() - start}


def quantize_command(folder: Path, flags: list[str], head: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "quantize", str(folder), "--method", "rtn", *flags,
            "--lm-head", head, "--stream", "--force", "--out", str(out)]


def _public(command: list[str], folder: Path, work: Path) -> str:
    """The command as a user would type it, without this machine's paths."""
    if command[:3] == [sys.executable, "-m", "llmeasyquant.cli"]:
        command = ["llmeasyquant", *command[3:]]
    return " ".join(command).replace(str(work), "WORK").replace(str(folder), folder.name)


def make_checkpoint(folder: Path, work: Path, name: str, timeout: float) -> tuple[Path, dict | None]:
    """Our checkpoint of scheme `name` in `work` (quantized unless already there); (path, what the step did)."""
    flags, head = OURS[name]
    out = work / f"{folder.name}-{name}"
    if (out / "config.json").is_file():
        return out, None
    command = quantize_command(folder, flags, head, out)
    step = run_child(command, work / f"{out.name}.log", timeout) | {"command": _public(command, folder, work)}
    if step["exit"] != 0:
        raise SystemExit(f"quantize {name} failed ({step['exit']}); see {work / out.name}.log")
    return out, step


def make_ggufs(folder: Path, work: Path, qtypes: list[str], timeout: float) -> tuple[dict, dict]:
    """The GGUF files of `qtypes` in `work` (made unless already there: RTN g32, exported, the checkpoint deleted);
    (files made, what each step did)."""
    ggufs, steps = {}, {}
    for qtype in qtypes:
        flags, head, _ = PEERS[qtype]
        path = work / f"{folder.name}-{qtype}.gguf"
        if not path.is_file():
            checkpoint = work / f"{folder.name}-{qtype}-g32"
            command = quantize_command(folder, flags, head, checkpoint)
            step = run_child(command, work / f"{checkpoint.name}.log", timeout) | {"command": _public(command, folder,
                                                                                                        work)}
            if step["exit"] == 0:
                export = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "export", str(checkpoint), "--to",
                          "gguf", "--no-check", "--force", "--out", str(path)]
                step["export"] = run_child(export, work / f"{path.name}.log", timeout) | {
                    "command": _public(export, folder, work)}
            shutil.rmtree(checkpoint, ignore_errors=True)
            steps[qtype] = step
        if path.is_file():
            ggufs[qtype] = path
    return ggufs, steps


def _tensors(prepared: object) -> Iterator[torch.Tensor]:
    """The tensors a kernel's prepared object holds (a tensor, a dict or tuple of them, or a dataclass)."""
    if isinstance(prepared, torch.Tensor):
        yield prepared
    elif isinstance(prepared, dict):
        for value in prepared.values():
            yield from _tensors(value)
    elif isinstance(prepared, list | tuple):
        for value in prepared:
            yield from _tensors(value)
    elif is_dataclass(prepared):
        for field in fields(prepared):
            yield from _tensors(getattr(prepared, field.name))


def _unique_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a view counted once, by where it starts and its size)."""
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(size for _, size in seen)


def _running_layers(model: nn.Module) -> list:
    """The QuantLinear layers a forward calls: a fused group's combined layer instead of its members."""
    from llmeasyquant.nn.qlinear import QuantLinear

    running = {}
    for layer in (m for m in model.modules() if isinstance(m, QuantLinear)):
        runner = layer.shared[0].combined if layer.shared is not None else layer
        running[id(runner)] = runner
    return list(running.values())


def decode_kernels(model: nn.Module) -> dict[str, int]:
    """Kernel name -> how many of the running layers use it for one-row inputs (after a decode ran)."""
    counts: dict[str, int] = {}
    for layer in _running_layers(model):
        for name in {kernel.name for (rows, _, _), kernel in layer._kernels.items() if rows == 1}:
            counts[name] = counts.get(name, 0) + 1
    return counts


def kernel_bytes_per_token(model: nn.Module) -> int:
    """Bytes a decode step reads as the kernels chosen for one-row inputs hold the weights (after a decode ran):
    their prepared tensors and the layer buffers they run on, plus every parameter and buffer outside the quantized
    layers (norms; not the looked-up embedding rows)."""
    from llmeasyquant.nn.qlinear import QuantLinear

    tensors: list[torch.Tensor] = []
    for layer in _running_layers(model):
        chosen = {kernel.name for (rows, _, _), kernel in layer._kernels.items() if rows == 1}
        if not chosen:
            raise ValueError("no decode kernel chosen yet: run a decode step before counting its bytes")
        for name in chosen:
            prepared = layer._prepared[name]
            tensors += list(_tensors(prepared))
            if prepared is None:  # the reference kernel: it reads the buffers themselves
                tensors += [t for t in (layer.qweight, layer.scales, layer.zeros) if t is not None]
            elif name not in REPACKING_KERNELS:  # the others read the stored codes and their prepared scales
                tensors.append(layer.qweight)
    quantized = {id(t) for m in model.modules() if isinstance(m, QuantLinear) for t in m.buffers()}
    head = getattr(model.get_output_embeddings(), "weight", None)
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tensors += [t for t in [*model.parameters(), *model.buffers()]
                if id(t) not in quantized and (id(t) not in looked_up or t is head)]
    return _unique_bytes(iter(tensors))


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all but the token embedding table (one row looked up),
    which llama.cpp reads whole as the output matrix when the file has no output.weight."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


class _Alarm:
    """Raise Timeout in the main thread after `seconds` (a hung or far too slow measurement ends the run)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def fire(signum: int, frame: object) -> None:
            raise Timeout(f"measurement ran past {self.seconds:.0f} s")

        signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def decode_speed(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Tokens per second of `new_tokens - 1` greedy lean-loop steps after a prefill of `prompt` [1, P]."""
    return (new_tokens - 1) / timed_greedy(model, prompt, new_tokens, "lean")[1]


def llama_bench(binary: Path, gguf: Path, new_tokens: int, threads: int, timeout: float,
                prompt_tokens: int = 0) -> dict:
    """One `llama-bench -p PROMPT -n NEW -r 1` run (it warms up first; -p 0 times decode, -n 0 a prompt's prefill);
    its tokens/s, or why there is none."""
    command = [str(binary), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(new_tokens), "-t", str(threads),
               "-r", "1", "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    found = json.loads(done.stdout)
    return {"tok_s": float(found[0]["avg_ts"]), "build": found[0].get("build_commit")}


def bound(bandwidth_gbs: float, bytes_per_token: int) -> float:
    """Tokens per second that reading `bytes_per_token` at `bandwidth_gbs` allows."""
    return bandwidth_gbs * 1e9 / bytes_per_token


def summarize(name: str, rounds: list[dict], stored: int, kernel: int, peers: dict[str, int]) -> dict:
    """One scheme's figures: medians over rounds, the bound from the median bandwidth, and llama.cpp beside it."""
    bandwidth = statistics.median(r["bandwidth_gbs"] for r in rounds)
    ours = [r["ours_tok_s"] for r in rounds if "ours_tok_s" in r]
    row = {"scheme": name, "stored_bytes_per_token": stored, "kernel_bytes_per_token": kernel,
           "bandwidth_gbs": bandwidth, "bound_tok_s": bound(bandwidth, stored),
           "ours_tok_s": statistics.median(ours) if ours else None, "rounds": rounds}
    if row["ours_tok_s"] is not None:
        row["fraction_of_bound"] = row["ours_tok_s"] / row["bound_tok_s"]
    row["llama_cpp"] = {}
    for qtype, per_token in peers.items():
        speeds = [r["llama_cpp"][qtype]["tok_s"] for r in rounds if "tok_s" in r["llama_cpp"].get(qtype, {})]
        peer = {"bytes_per_token": per_token, "bound_tok_s": bound(bandwidth, per_token),
                "tok_s": statistics.median(speeds) if speeds else None}
        if peer["tok_s"] is not None:
            peer["fraction_of_bound"] = peer["tok_s"] / peer["bound_tok_s"]
            if row["ours_tok_s"] is not None:
                peer["ours_over_llama_cpp"] = row["ours_tok_s"] / peer["tok_s"]
        else:
            peer["error"] = next((r["llama_cpp"][qtype]["error"] for r in rounds if qtype in r["llama_cpp"]),
                                 "not measured")
        row["llama_cpp"][qtype] = peer
    return row


def measure(name: str, checkpoint: Path, ggufs: dict[str, Path], binary: Path | None,
            args: argparse.Namespace) -> dict:
    from llmeasyquant import fuse_shared_inputs, load
    from llmeasyquant.nn.placement import place_on_huge_pages

    started = conditions()
    load_start = time.perf_counter()
    model, _ = load(checkpoint)
    model.eval()
    load_s = time.perf_counter() - load_start
    stored = weight_bytes_per_token(model)
    fuse_shared_inputs(model)
    huge_page_bytes = place_on_huge_pages(model)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), generator=generator)
    peers = {q: p for q, p in ggufs.items() if name in PEERS[q][2]} if binary is not None else {}
    rounds = []
    with _Alarm(args.timeout):
        decode_speed(model, prompt[:, :8], 3)  # warm-up: kernels chosen and prepared, buffers allocated
        kernel = kernel_bytes_per_token(model)
        kernels = decode_kernels(model)
        for index in range(args.repeats):
            round_ = {"round": index, "bandwidth_gbs": memory_bandwidth_gbs(), "bandwidth_conditions": conditions()}
            round_["ours_tok_s"] = decode_speed(model, prompt, args.new_tokens)
            round_["ours_conditions"] = conditions()
            round_["llama_cpp"] = {}
            for qtype, path in peers.items():
                round_["llama_cpp"][qtype] = llama_bench(binary, path, args.new_tokens, args.threads, args.timeout)
                round_["llama_cpp"][qtype] |= {"conditions": conditions()}
            rounds.append(round_)
            print(f"{name} round {index}: ours {round_['ours_tok_s']:.2f} tok/s; "
                  + ", ".join(f"{q} {r.get('tok_s', r.get('error'))}" for q, r in round_["llama_cpp"].items())
                  + f"; load {round_['ours_conditions']['loadavg'][0]}", flush=True)
    del model  # before the next scheme loads: at 8B two models do not fit beside llama.cpp's mapped file
    gc.collect()
    release_freed_memory()
    row = summarize(name, rounds, stored, kernel, {q: gguf_bytes_per_token(p) for q, p in peers.items()})
    return row | {"decode_kernels": kernels, "load_s": load_s, "huge_page_bytes": huge_page_bytes,
                  "conditions_before": started,
                  "conditions_after": conditions()}


def find_llama_bench(path: Path | None) -> tuple[Path | None, str | None]:
    """The llama-bench binary, or None and why."""
    if path is None:
        return None, "no --llama-bench given: llama.cpp rows skipped"
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"--llama-bench {path} is not an executable file: llama.cpp rows skipped"
    return path, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a Hugging Face folder (benchmarks/make_synthetic.py)")
    parser.add_argument("--work", type=Path, required=True, help="where checkpoints, GGUF files and logs go")
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary (else no llama.cpp rows)")
    parser.add_argument("--schemes", default=",".join(OURS), help=f"comma-separated, of {', '.join(OURS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for any one step (default 1800)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and GGUF files in --work")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale_speed.json"))
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or args.prompt_tokens < 8:
        parser.error("need --new-tokens >= 2, --repeats >= 1 and --prompt-tokens >= 8")
    schemes = args.schemes.split(",")
    unknown = sorted(set(schemes) - set(OURS))
    if unknown:
        parser.error(f"unknown schemes {unknown}; choose from {', '.join(OURS)}")
    folder = args.folder.resolve()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    binary, skipped = find_llama_bench(args.llama_bench)
    if skipped:
        print(skipped, flush=True)
    config = json.loads((folder / "config.json").read_text())
    model = f"synthetic {folder.name} ({config['num_hidden_layers']} layers of {config['hidden_size']})"
    qtypes = [q for q, (_, _, beside) in PEERS.items() if set(beside) & set(schemes)] if binary is not None else []
    command = ("python benchmarks/scale_speed.py " + folder.name + " --work WORK"
               + (" --llama-bench LLAMA_BENCH" if binary else "")
               + f" --threads {args.threads} --repeats {args.repeats} --prompt-tokens {args.prompt_tokens}"
               + f" --new-tokens {args.new_tokens} --schemes {args.schemes}")
    protocol = {"batch": 1, "prompt": f"{args.prompt_tokens} seeded random token ids (seed {args.seed})",
                "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                "threads": args.threads,
                "runtime": "lean (fused operators), q/k/v and gate/up fused, weights on 2 MiB pages",
                "order": "per scheme: quantize, load; then each round: bandwidth, ours, llama-bench on each GGUF of "
                         "its bits",
                "llama_bench": "llama-bench -m F -p 0 -n NEW -t THREADS -r 1 -o json (avg_ts), once per round",
                "bound": "bandwidth_gbs * 1e9 / stored_bytes_per_token", "timeout_s": args.timeout,
                "machine": machine(), "llama_cpp_skipped": skipped}
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    ggufs: dict[str, Path] = {}
    try:
        ggufs, gguf_steps = make_ggufs(folder, work, qtypes, args.timeout)
        for name in schemes:
            checkpoint, step = make_checkpoint(folder, work, name, args.timeout)
            row = measure(name, checkpoint, ggufs, binary, args)
            if not args.keep:
                shutil.rmtree(checkpoint, ignore_errors=True)
            peers = {q: {"head": PEERS[q][1], "made": gguf_steps.get(q)} for q in row["llama_cpp"]}
            record = Record.new("scale_speed", model, row, protocol | {
                "scheme": name, "head": OURS[name][1], "quantize": step, "peers": peers}, command)
            records = read_records(args.out) if args.out.is_file() else []
            write_records(args.out, [r for r in records if (r.model, r.protocol.get("scheme")) != (model, name)]
                          + [record])  # after each scheme: a long run keeps what it measured
            print(f"{model} {name}: {row['stored_bytes_per_token'] / 1e6:.0f} MB/token, bound "
                  f"{row['bound_tok_s']:.2f} tok/s, ours {row['ours_tok_s']:.2f} "
                  f"({100 * row['fraction_of_bound']:.0f}%)"
                  + "".join(f"; llama.cpp {q} {p['tok_s']:.2f}" if p.get("tok_s") else f"; {q}: {p.get('error')}"
                            for q, p in row["llama_cpp"].items()), flush=True)
    finally:
        torch.set_num_threads(before)
        if not args.keep:
            for path in ggufs.values():
                path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
