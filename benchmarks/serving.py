"""Serving throughput and latency on loopback: our server (each scheme, float and 4-bit KV cache) against
llama.cpp's `llama-server` on the same machine, and transformers' `generate` one request at a time.

    python benchmarks/serving.py [--clients 1,4,16,64] [--rows fp32,w8a16,w8a8,w4a16] [--kv float,4]
        [--llama-server PATH] [--work DIR] [--out benchmarks/results/serving.json]
    python benchmarks/serving.py --pairs w8a8,w4a16-g32,w4a8-g32 --rounds 3 --llama-server PATH [--clients 1,4,16,64]
        [--work DIR] [--out benchmarks/results/serving_pairs.json]

With --pairs, matched bits against llama-server in interleaved rounds (PAIRS): ours W8A8 with the LM head W8A8
against Q8_0 (our lossless export of RTN W8A16 g32 with its head: 8.5 bits against our 8.0 and a scale a row), and
ours W4A16 g32 with the head W4A16 g32 against that same checkpoint exported to Q4_0 (the same weights and bytes),
and ours W4A8 g32 with int8 activations scaled per token per 32 columns (head too) against its Q4_0 export: the
same weights, and the arithmetic of llama.cpp's Q4_0 dot product, which rounds activations to Q8_0 blocks of 32.
Each round runs every server in a shuffled order; ours serves every level from one start (fp16 KV cache,
`--max-running` the largest level), llama-server restarts for each level with `-np` equal to its clients and
`-cb`. Medians over the rounds per server and level.

Protocol: SmolLM2-135M-Instruct (the bundled model). Prompts are 128-token windows cut one after another from
WikiText-2 raw test (shipped), sent as token ids to /v1/completions with `stream: true`, 128 greedy tokens each
with end-of-sequence ignored. At each level, N clients each send requests back to back until the level's fixed
number of requests (max(N, 4)) is done, each on a new connection; one warm-up request on a 65th window, which
no level sends, precedes the levels. Measured at the client:
aggregate output tokens/s (all tokens over the level's wall time), requests/s, time to first token and
inter-token latency (between consecutive streamed chunks) at p50 and p99, and the server's peak RSS (VmHWM) at the
end. Every server gets 2 threads and listens on 127.0.0.1. Our checkpoints are quantized with RTN (weights, with
the LM head at W8A16); llama-server runs on our lossless Q8_0 export of the W8A16 g32 checkpoint and on the
bundled Q4_1 file, with `-np` slots equal to the largest client count and continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmeasyquant.models.load import bundled_gguf
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table
from scale_speed import machine

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = NEW_TOKENS = 128
SCHEMES = {  # row -> quantize options (RTN), None for the unquantized model
    "fp32": None,
    "w8a16": ["--bits", "8"],
    "w8a8": ["--bits", "8", "--act-bits", "8"],
    "w4a16": ["--bits", "4", "--group-size", "64", "--asym"],
}
# pair: (our quantize options, our LM head, the llama.cpp type served beside it)
PAIRS = {"w8a8": (["--bits", "8", "--act-bits", "8"], "w8a8", "Q8_0"),
         "w4a16-g32": (["--bits", "4", "--group-size", "32"], "w4a16-g32", "Q4_0"),
         "w4a8-g32": (["--bits", "4", "--group-size", "32", "--act-bits", "8", "--act-group-size", "32"],
                      "w4a8-g32-ag32", "Q4_0")}
COLUMNS = (("server", "server", ""), ("clients", "clients", "d"), ("out tok/s", "output_tok_s", ".1f"),
           ("req/s", "requests_s", ".2f"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
           ("TTFT p99 ms", "ttft_p99_ms", ".0f"), ("ITL p50 ms", "itl_p50_ms", ".1f"),
           ("ITL p99 ms", "itl_p99_ms", ".1f"), ("peak RSS MB", "peak_rss_mb", ".0f"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quantized(work: Path, name: str, options: list[str], head: str = "w8a16") -> Path:
    out = work / f"{name}-head"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", "quantize", "smollm2-135m", "--method",
                        "rtn", *options, "--lm-head", head, "--out", str(out)], check=True)
    return out


def q8_0_export(work: Path) -> Path:
    """Our W8A16 g32 checkpoint (symmetric, LM head too) exported to GGUF: Q8_0 holds its codes exactly."""
    out = work / "w8a16-g32.gguf"
    if not out.exists():
        ckpt = quantized(work, "w8a16-g32", ["--bits", "8", "--group-size", "32"], head="w8a16-g32")
        subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", "export", str(ckpt), "--to", "gguf",
                        "--out", str(out), "--no-check"], check=True)
    return out


def pair_gguf(work: Path, pair: str, checkpoint: Path) -> Path:
    """The GGUF llama-server runs beside `pair`: Q8_0 of RTN W8A16 g32, or our own W4 g32 checkpoint as Q4_0."""
    if PAIRS[pair][2] == "Q8_0":
        return q8_0_export(work)
    out = work / f"{checkpoint.name}.gguf"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "llmeasyquant.cli", "--quiet", "export", str(checkpoint), "--to", "gguf",
                        "--out", str(out), "--no-check"], check=True)
    return out


def prompts(count: int) -> list[list[int]]:
    from llmeasyquant.calibration.data import load_text, tokenize
    from llmeasyquant.models.load import load_model

    _, tokenizer = load_model("smollm2-135m")
    ids = tokenize(tokenizer, load_text("wikitext2").text)
    return [ids[i * PROMPT_TOKENS:(i + 1) * PROMPT_TOKENS].tolist() for i in range(count)]


class Server:
    """A server subprocess on a free loopback port; always stopped by `stop()` (SIGTERM, then SIGKILL)."""

    def __init__(self, command: list[str], port: int, ready_path: str = "/health", timeout_s: float = 600) -> None:
        self.port, self.log = port, open(f"/tmp/serving-bench-{port}.log", "w")  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded: at most timeout_s, one poll a second
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s; see {self.log.name}")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    arrivals: list[float] = []
    finish = None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:  # a failed request must not count as served tokens
                raise RuntimeError(f"the server streamed an error: {chunk['error']}")
            choices = chunk.get("choices", [])
            if any(choice.get("text") for choice in choices):
                arrivals.append(time.perf_counter())
            finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), finish)
    if finish != "length":  # end of sequence is ignored: every request runs to max_tokens
        raise RuntimeError(f"a request ended with finish_reason {finish!r}, not 'length'")
    return {"start": start, "arrivals": arrivals}


async def level(port: int, model: str, clients: int, requests: int, texts: list[list[int]]) -> dict:
    url = f"http://127.0.0.1:{port}/v1/completions"
    queue = list(range(requests))
    results: list[dict] = []
    timeout = httpx.Timeout(600.0)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            index = queue.pop()
            results.append(await one_request(client, url, model, texts[index % len(texts)]))

    # A connection a request: a kept-alive one that the server closes as the next request goes out fails with
    # RemoteProtocolError (seen with llama-server); a loopback connect costs far less than a token.
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - start
    ttft = [1e3 * (r["arrivals"][0] - r["start"]) for r in results if r["arrivals"]]
    itl = [1e3 * (b - a) for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    tokens = requests * NEW_TOKENS
    chunks = sum(len(r["arrivals"]) for r in results)
    return {"clients": clients, "requests": requests, "output_tok_s": tokens / wall, "requests_s": requests / wall,
            "wall_s": wall, "streamed_chunks": chunks, "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99)}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(name: str, command: list[str], port: int, model: str, levels: list[int], texts: list[list[int]],
            ready_path: str = "/health") -> list[dict]:
    print(f"== {name}", flush=True)
    server = Server(command, port, ready_path)
    rows = []
    try:
        # Warm-up on the last prompt, which no level sends (a server's prompt cache must not serve a level from it)
        asyncio.run(level(port, model, 1, 1, [texts[-1]]))
        texts = texts[:-1]
        for clients in levels:
            row = asyncio.run(level(port, model, clients, max(clients, 4), texts))
            row |= {"server": name, "peak_rss_mb": server.peak_rss_mb()}
            print(f"   {clients:3d} clients: {row['output_tok_s']:.1f} tok/s, ITL p50 {row['itl_p50_ms']:.1f} ms "
                  f"p99 {row['itl_p99_ms']:.1f} ms", flush=True)
            rows.append(row)
    finally:
        server.stop()
    return rows


def llama_command(binary: str, gguf: Path, port: int, slots: int) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2", "-np",
            str(slots), "-c", str(slots * (PROMPT_TOKENS + NEW_TOKENS)), "-cb", "--no-webui"]


def paired_rounds(args: argparse.Namespace, levels: list[int], texts: list[list[int]]) -> list[dict]:
    """Rows of every round (see the module's docstring, --pairs), then one median row per server and level."""
    ours = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "--threads", "2", "serve"]
    servers = []
    for pair in args.pairs.split(","):
        options, head, qtype = PAIRS[pair]
        checkpoint = quantized(args.work, pair, options, head=head)
        servers += [(f"ours {pair} + head {head}", pair, checkpoint), (f"llama-server {qtype}", pair,
                                                                        pair_gguf(args.work, pair, checkpoint))]
    order = random.Random(0)
    rounds: list[dict] = []
    for index in range(args.rounds):
        for name, pair, target in order.sample(servers, len(servers)):
            if name.startswith("ours"):
                port = free_port()
                command = [*ours, str(target), "--port", str(port), "--kv-memory", str(args.kv_memory),
                           "--max-running", str(max(levels)), "--served-model-name", "m"]
                if args.prefill_chunk:
                    command += ["--prefill-chunk", str(args.prefill_chunk)]
                found = measure(name, command, port, "m", levels, texts)
            else:
                found = []
                for clients in levels:
                    port = free_port()
                    found += measure(name, llama_command(args.llama_server, target, port, clients), port, "m",
                                     [clients], texts)
            rounds += [row | {"round": index, "pair": pair} for row in found]
    medians = []
    for name, pair, _ in servers:
        for clients in levels:
            runs = [r for r in rounds if r["server"] == name and r["clients"] == clients]
            row = {key: statistics.median(r[key] for r in runs) for key in runs[0]
                   if isinstance(runs[0][key], float)}
            medians.append(row | {"server": name, "pair": pair, "clients": clients, "median_of": len(runs),
                                  "output_tok_s_runs": [r["output_tok_s"] for r in runs]})
    return medians


def transformers_row(texts: list[list[int]], requests: int) -> dict:
    """transformers' generate, one request at a time (batch 1), 2 threads, greedy 128 tokens."""
    import torch

    from llmeasyquant.models.load import load_model

    torch.set_num_threads(2)
    model, _ = load_model("smollm2-135m")
    ttft, itl = [], []
    start = time.perf_counter()
    for index in range(requests):
        ids = torch.tensor([texts[index % len(texts)]])
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft.append(1e3 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        itl.append(1e3 * (time.perf_counter() - t0 - ttft[-1] / 1e3) / (NEW_TOKENS - 1))
    wall = time.perf_counter() - start
    return {"server": "transformers generate (fp32, one at a time)", "clients": 1, "requests": requests,
            "output_tok_s": requests * NEW_TOKENS / (wall - sum(ttft) / 1e3), "requests_s": requests / wall,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(itl, 50),
            "itl_p99_ms": _pct(itl, 99), "peak_rss_mb": float("nan")}


def kv_capacity(kv_memory_mb: float) -> dict[str, int]:
    """Sequences of 1,024 tokens each KV cache of the serving engine holds in `kv_memory_mb` (SmolLM2 shapes)."""
    import torch

    from llmeasyquant.nn.kv.config import KVQuantConfig
    from llmeasyquant.runtime.kv_pool import MIB, FloatPool, QuantPool, Shape

    shape, budget, table = Shape(30, 3, 64, 9), int(kv_memory_mb * MIB), torch.zeros(2048, 64)
    found = {"float16": FloatPool(shape, budget, 64, 2048, "float16").capacity(1024)}
    for bits in (8, 4, 3, 2):
        pool = QuantPool(shape, budget, 64, 2048, KVQuantConfig(key_bits=bits, value_bits=bits), table, table)
        found[f"{bits}-bit"] = pool.capacity(1024)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--rows", default=",".join(SCHEMES))
    parser.add_argument("--kv", default="float,4", help="KV caches of our server: float (fp16) and/or bit widths")
    parser.add_argument("--kv-memory", type=float, default=512.0, help="MiB of KV cache for our server")
    parser.add_argument("--prefill-chunk", type=int, help="our server's --prefill-chunk (default: its own)")
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server binary (omit: no peer rows)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--pairs", help=f"matched pairs against llama-server, interleaved rounds: {', '.join(PAIRS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --pairs (medians reported)")
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "serving", help="checkpoints are made here")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serving.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    texts = prompts(65)  # 64 for the levels, one for the warm-ups
    if args.pairs:
        if not args.llama_server or any(pair not in PAIRS for pair in args.pairs.split(",")) or args.rounds < 1:
            parser.error(f"--pairs takes {', '.join(PAIRS)}, with --llama-server and --rounds >= 1")
        rows = paired_rounds(args, levels, texts)
        print(markdown_table(rows, COLUMNS))
        protocol = {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "greedy": True, "ignore_eos": True,
                    "requests_per_level": "max(clients, 4)", "threads": 2, "text": "WikiText-2 raw test (shipped)",
                    "kv_cache": "float16", "kv_memory_mb": args.kv_memory, "rounds": args.rounds,
                    "prefill_chunk": args.prefill_chunk or "server default",
                    "llama_server": "-np CLIENTS -cb, restarted for each level", "machine": machine()}
        command = " ".join(["python", "benchmarks/serving.py", *(Path(a).name if a.startswith("/") else a
                                                                   for a in sys.argv[1:])])
        write_records(args.out, [Record.new("serving", row["server"], row, protocol, command) for row in rows])
        print(f"wrote {args.out}")
        return 0
    ours = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "--threads", "2", "serve"]
    rows: list[dict] = []
    for name in args.rows.split(","):
        target = "smollm2-135m" if SCHEMES[name] is None else str(quantized(args.work, name, SCHEMES[name]))
        label = name if SCHEMES[name] is None else f"{name} + head"
        for kv in args.kv.split(","):
            port = free_port()
            cache = [] if kv == "float" else ["--kv-bits", kv]
            if args.prefill_chunk:
                cache += ["--prefill-chunk", str(args.prefill_chunk)]
            command = [*ours, target, "--port", str(port), "--kv-memory", str(args.kv_memory),
                       "--max-running", str(max(levels)), "--served-model-name", "m", *cache]
            kv_name = "fp16 KV" if kv == "float" else f"{kv}-bit KV"
            rows += measure(f"ours {label}, {kv_name}", command, port, "m", levels, texts)
    if args.llama_server:
        for name, gguf in (("Q8_0 (our export)", q8_0_export(args.work)), ("Q4_1 (bundled)", bundled_gguf())):
            port = free_port()
            command = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                       "-tb", "2", "-np", str(max(levels)), "-c", str(max(levels) * (PROMPT_TOKENS + NEW_TOKENS)),
                       "-cb", "--no-webui"]
            rows += measure(f"llama-server {name}", command, port, "m", levels, texts)
    if not args.no_transformers:
        rows.append(transformers_row(texts, 4))
    print(markdown_table(rows, COLUMNS))
    protocol = {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "greedy": True, "ignore_eos": True,
                "requests_per_level": "max(clients, 4)", "threads": 2, "text": "WikiText-2 raw test (shipped)",
                "kv_memory_mb": args.kv_memory, "prefill_chunk": args.prefill_chunk or "server default",
                "kv_capacity_1024_tokens": kv_capacity(args.kv_memory)}
    command = " ".join(["python", "benchmarks/serving.py", *sys.argv[1:]])
    write_records(args.out, [Record.new("serving", row["server"], row, protocol, command) for row in rows])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
