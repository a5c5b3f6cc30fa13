"""Quantization at real sizes with bounded memory: `llmeasyquant quantize DIR --stream` on a synthetic checkpoint
(benchmarks/make_synthetic.py), one subprocess per configuration, its peak RSS measured by the kernel.

    python benchmarks/scale.py DIR [--configs rtn,gptq,awq] [--calib-samples 16] [--calib-seqlen 512]
        [--load] [--work DIR] [--out benchmarks/results/scale.json]

For each configuration (W4A16 g128 with the method named) the quantize CLI runs in a child process with
`--stream --estimate`: it times the first one and two blocks, logs the estimate, then quantizes every block and
writes the sharded checkpoint. The child's peak resident set size comes from wait4()'s rusage (ru_maxrss: the
largest RSS the process ever had, file pages it touched included); the times per block, the quantization time and
the estimate come from the record the CLI writes. `--load` then loads each checkpoint with
export/checkpoint.load (what `eval`, `bench` and `serve` do first) in another child and records its peak RSS and
time. Checkpoints go to --work (default: a temporary folder) and are deleted after. Records are merged into --out
by (model, method): the name of DIR and its shape stand for the model, so no absolute path is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmeasyquant.record import Record, read_records, write_records

SCHEME = ["--bits", "4", "--group-size", "128"]  # W4A16 g128, symmetric: the configuration


def run_measured(command: list[str], log: Path) -> tuple[int, float, float]:
    """Run `command` with its output in `log`; (exit status, peak RSS in GB, wall seconds)."""
    start = time.perf_counter()
    with log.open("w") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, usage.ru_maxrss * 1024 / 1e9, time.perf_counter() - start  # ru_maxrss is in KiB


def measure(folder: Path, method: str, args: argparse.Namespace, work: Path) -> Record:
    out, record_file = work / f"{folder.name}-{method}", work / f"{folder.name}-{method}.json"
    calib = [] if method == "rtn" else ["--calib", "wikitext2", "--calib-samples", str(args.calib_samples),
                                        "--calib-seqlen", str(args.calib_seqlen)]
    cli = ["quantize", folder.name, "--method", method, *SCHEME, *calib, "--stream", "--estimate", "--force",
           "--out", "OUT", "--json", "RECORD"]
    command = [sys.executable, "-m", "llmeasyquant.cli", "--quiet",
               *[{"OUT": str(out), "RECORD": str(record_file), folder.name: str(folder)}.get(a, a) for a in cli]]
    code, rss, wall = run_measured(command, work / f"{folder.name}-{method}.log")
    if code != 0:
        raise SystemExit(f"{method} failed (exit {code}); see {work / f'{folder.name}-{method}.log'}")
    quantized = Record.from_dict(json.loads(record_file.read_text()), record_file)
    config = json.loads((folder / "config.json").read_text())
    metrics = dict(quantized.metrics) | {"peak_rss_gb": rss, "wall_s": wall}
    metrics["estimate_error"] = metrics["estimate_s"] / metrics["quantize_s"] - 1
    if args.load:  # the loader alone: what eval, bench and serve do first (their own work comes on top)
        code, rss, wall = run_measured([sys.executable, "-c", "import sys; from llmeasyquant.export.checkpoint import "
                                        "load; load(sys.argv[1])", str(out)], work / f"{folder.name}-load.log")
        metrics |= {"load_peak_rss_gb": rss, "load_s": wall} if code == 0 else {"load_exit": code}
    shutil.rmtree(out, ignore_errors=True)
    protocol = {"method": method, "scheme": "w4a16-g128", "stream": True, "calib": "wikitext2" if calib else None,
                "calib_samples": args.calib_samples if calib else 0, "calib_seqlen": args.calib_seqlen if calib else 0,
                "hidden_size": config["hidden_size"], "layers": config["num_hidden_layers"],
                "intermediate_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
                "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    name = f"synthetic {folder.name} ({config['num_hidden_layers']} layers of {config['hidden_size']})"
    command_line = "llmeasyquant --quiet " + " ".join(a for a in cli if a not in ("--json", "RECORD"))
    return Record.new("scale", name, metrics, protocol, command_line.replace("OUT", "CHECKPOINT"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a Hugging Face folder (benchmarks/make_synthetic.py)")
    parser.add_argument("--configs", default="rtn,gptq,awq", help="methods, comma-separated (default rtn,gptq,awq)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--load", action="store_true", help="also load each checkpoint (export/checkpoint.load, "
                        "as eval and bench do) in a child process and record its peak RSS")
    parser.add_argument("--work", type=Path, help="where checkpoints and logs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.json"))
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="scale-"))
    work.mkdir(parents=True, exist_ok=True)
    records = read_records(args.out) if args.out.is_file() else []
    for method in args.configs.split(","):
        record = measure(args.folder.resolve(), method, args, work)
        records = [r for r in records if (r.model, r.protocol["method"]) != (record.model, method)] + [record]
        write_records(args.out, records)  # after each configuration: a long run keeps what it measured
        m = record.metrics
        print(f"{record.model} {method}: peak RSS {m['peak_rss_gb']:.2f} GB, {m['blocks']} blocks, median "
              f"{m['block_s_median']:.1f} s per block, quantized in {m['quantize_s']:.0f} s (estimate "
              f"{m['estimate_s']:.0f} s, {100 * m['estimate_error']:+.0f}%), wall {m['wall_s']:.0f} s"
              + (f"; load peak RSS {m['load_peak_rss_gb']:.2f} GB" if "load_peak_rss_gb" in m else ""))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
