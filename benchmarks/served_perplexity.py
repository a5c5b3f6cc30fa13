"""Perplexity through the HTTP API: the served model scores WikiText-2 windows the way lm-evaluation-harness's
`local-completions` scores a log-likelihood (token ids, `echo`, `logprobs`, `max_tokens` 0), beside
`llmeasyquant eval` of the same model on the same windows.

    python benchmarks/served_perplexity.py [--model smollm2-135m] [--max-windows 8] [--kv float32,4,3]
        [--batch 4] [--out benchmarks/results/served_perplexity.json]

Protocol: the evaluation protocol (eval/perplexity.py: WikiText-2 raw test, shipped; windows of 512 tokens without
BOS; every position but the last predicts the next), its first `--max-windows` windows. The reference is
`llmeasyquant --threads 2 eval MODEL` on those windows. Each served row starts `llmeasyquant --threads 2 serve
MODEL` on a free loopback port with that KV cache (`--kv-dtype float32|float16`, or `--kv-bits B`: the serving pool's
SimQuant coding), sends the windows `--batch` at a time, each request a list of prompts with `echo: true,
logprobs: 0, max_tokens: 0`, and takes exp of the mean negative log probability of the prompt tokens after the
first; the server is stopped after its row. The float32 row checks that the server scores as the evaluator does;
the quantized rows show what the serving pool's KV cache costs over a whole 512-token context.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from llmeasyquant.calibration.data import load_text
from llmeasyquant.eval.perplexity import make_windows
from llmeasyquant.models.load import load_model
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table
from serving import Server, free_port

CLI = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "--threads", "2"]
COLUMNS = (("KV cache", "kv", ""), ("ppl", "ppl", ".4f"), ("vs eval %", "delta_vs_eval_pct", "+.4f"),
           ("tokens", "tokens", "d"), ("seconds", "seconds", ".1f"))


def reference(model: str, windows: int) -> float:
    """`llmeasyquant eval`'s perplexity of the model on the first `windows` windows."""
    with tempfile.TemporaryDirectory() as work:
        record = Path(work) / "eval.json"
        subprocess.run([*CLI, "eval", model, "--max-windows", str(windows), "--json", str(record)], check=True)
        return json.loads(record.read_text())["metrics"]["ppl"]


def served(model: str, kv: str, windows: list[list[int]], batch: int) -> dict:
    """The served perplexity of the windows with one KV cache: `float32`, `float16` or a bit width."""
    port = free_port()
    cache = ["--kv-dtype", kv] if kv.startswith("float") else ["--kv-bits", kv]
    server = Server([*CLI, "serve", model, "--port", str(port), "--served-model-name", "m", *cache], port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
        nll, tokens, start = 0.0, 0, time.perf_counter()
        for first in range(0, len(windows), batch):  # len(windows) / batch requests, each bounded by the timeout
            answer = client.completions.create(model="m", prompt=windows[first:first + batch], echo=True,
                                               logprobs=0, max_tokens=0)
            for choice in answer.choices:
                scored = choice.logprobs.token_logprobs[1:]  # the first token has none: nothing predicts it
                nll -= sum(scored)
                tokens += len(scored)
        return {"kv": kv, "ppl": math.exp(nll / tokens), "tokens": tokens, "seconds": time.perf_counter() - start,
                "peak_rss_mb": server.peak_rss_mb()}
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model spec or checkpoint folder")
    parser.add_argument("--max-windows", type=int, default=8)
    parser.add_argument("--kv", default="float32,4,3", help="float32, float16 and/or KV cache bit widths (2, 3, 4, 8)")
    parser.add_argument("--batch", type=int, default=4, help="windows per request")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/served_perplexity.json"))
    args = parser.parse_args()
    _, tokenizer = load_model(args.model)
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    ids = windows.ids.tolist()
    expected = reference(args.model, args.max_windows)
    rows = [{"kv": "eval (llmeasyquant eval)", "ppl": expected, "tokens": len(ids) * 511}]
    for kv in args.kv.split(","):
        row = served(args.model, kv.strip(), ids, args.batch)
        row["delta_vs_eval_pct"] = 100 * (row["ppl"] / expected - 1)
        rows.append(row)
        print(f"{row['kv']}: ppl {row['ppl']:.4f} ({row['delta_vs_eval_pct']:+.4f}% vs eval) in {row['seconds']:.1f} s",
              flush=True)
    print(markdown_table(rows, COLUMNS))
    protocol = {**windows.protocol, "batch": args.batch, "threads": 2,
                "request": {"echo": True, "logprobs": 0, "max_tokens": 0}}
    write_records(args.out, Record.new("served_perplexity", args.model, {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
