"""llama.cpp's own quantizer on SmolLM2-135M, evaluated on our protocol: the peer row of the accuracy frontier.

    python benchmarks/peers/llama_quantize.py --tools BUILD/bin [--types Q4_0,Q4_1,IQ4_NL] [--max-windows 40]
        [--ours NAME=FILE.gguf ...] [--llama-perplexity-chunks N] [--work out/llama-quantize]
        [--out benchmarks/results/llama_quantize.json]

`--tools` is the folder holding `llama-imatrix`, `llama-quantize` and `llama-perplexity`, built with CMake from the
llama.cpp sources inside the llama-cpp-python source package (docs/RESULTS.md says how). `--ours` adds GGUF files
we exported (`llmeasyquant export --to gguf`), evaluated alike. Not part of CI.

Protocol:
- Input: the bundled Q4_1 file, requantized (`--allow-requantize`): llama-quantize dequantizes it to fp32 first, which
  is exactly the fp32 model every other row starts from.
- Importance matrix: `llama-imatrix` on the text our calibration uses (WikiText-2 validation), 64 chunks of 512
  tokens, the same tokens our GPTQ calibration reads (llama.cpp puts a BOS before each chunk).
- Quantization: `--pure` (every block weight the named type, none promoted), token embeddings kept F32 as in our
  rows; each type with the importance matrix, and Q4_0 also without it.
- Evaluation: each file loaded through transformers' GGUF reader (gguf-py dequantizes it) and run on WikiText-2 raw
  test, windows of 512 tokens without BOS, the first `max_windows`, against the fp32 model on the same windows.
- Bits per weight: the bytes of the block weights in the file (codes and block scales) over their count.
- In llama.cpp itself (`--llama-perplexity-chunks N`): `llama-perplexity` on every file, WikiText-2 raw test, its own
  protocol (512-token chunks with BOS, the second half of each scored), the first N chunks: the files run there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from gguf import GGUFReader

import llmeasyquant as lq
from llmeasyquant.calibration.data import load_text
from llmeasyquant.eval.perplexity import evaluate_windows, make_windows
from llmeasyquant.models.load import bundled_gguf
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = (("file", "name", ""), ("bits/w", "bits_per_weight", ".3f"), ("ppl", "ppl", ".3f"),
           ("Δppl %", "ppl_delta_pct", "+.2f"), ("KL", "kld", ".4f"), ("top-1 %", "top1_pct", ".2f"),
           ("quantize s", "quantize_s", ".1f"), ("llama-perplexity", "llama_perplexity", ".3f"))
TIMEOUT_S = 1800  # each tool run; the importance matrix of 64 chunks takes a few minutes on 2 cores


def run_tool(command: list[str]) -> tuple[float, str]:
    """Run one llama.cpp tool to completion; (seconds it took, what it logged). Its output is shown on failure."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start, done.stdout + done.stderr


def llama_perplexity(tool: Path, model: Path, text: Path, chunks: int, threads: list[str]) -> float:
    """llama.cpp's own perplexity of `model` on the first `chunks` 512-token chunks of `text`."""
    _, log = run_tool([str(tool), "-m", str(model), "-f", str(text), "-c", "512", "--chunks", str(chunks),
                       *threads])
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no final estimate for {model}:\n{log[-2000:]}")
    return float(found.group(1))


def named_files(values: list[str], parser: argparse.ArgumentParser) -> dict[str, Path]:
    files = {}
    for value in values:
        name, _, path = value.rpartition("=")
        if not name or not Path(path).is_file():
            parser.error(f"--ours takes NAME=FILE.gguf with an existing file, got {value!r}")
        files[name] = Path(path)
    return files


def block_bits_per_weight(path: Path) -> float:
    """Stored bits per weight of the blocks' matrices (codes and block scales), as GGUF holds them."""
    bits = weights = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            bits += 8 * int(tensor.n_bytes)
            weights += int(tensor.n_elements)
    return bits / weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", type=Path, required=True, help="folder of llama-imatrix and llama-quantize")
    parser.add_argument("--types", default="Q4_0,Q4_1,IQ4_NL")
    parser.add_argument("--max-windows", type=int, default=40)
    parser.add_argument("--calib-chunks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ours", action="append", default=[], help="NAME=FILE.gguf: one of our exports, evaluated too")
    parser.add_argument("--llama-perplexity-chunks", type=int, default=0, help="also run llama-perplexity (0: no)")
    parser.add_argument("--work", type=Path, default=ROOT / "out/llama-quantize")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/llama_quantize.json")
    args = parser.parse_args()
    tools = {name: args.tools / name for name in ("llama-imatrix", "llama-quantize", "llama-perplexity")}
    ours = named_files(args.ours, parser)
    missing = [str(path) for path in tools.values() if not path.is_file()]
    if missing:
        parser.error(f"not found: {', '.join(missing)}; build llama.cpp's tools and pass their folder to --tools")
    args.work.mkdir(parents=True, exist_ok=True)
    source = bundled_gguf()
    calib_text = load_text("wikitext2", split="validation")
    calib_file = args.work / "calib.txt"
    calib_file.write_text(calib_text.text)
    imatrix = args.work / "imatrix.gguf"
    threads = ["-t", str(args.threads)]
    imatrix_s, _ = run_tool([str(tools["llama-imatrix"]), "-m", str(source), "-f", str(calib_file), "-c", "512",
                          "--chunks", str(args.calib_chunks), "-o", str(imatrix), *threads])
    print(f"importance matrix in {imatrix_s:.1f} s", flush=True)

    files: dict[str, tuple[Path, float]] = {}
    runs = [(qtype, True) for qtype in args.types.split(",") if qtype.strip()] + [("Q4_0", False)]
    for qtype, with_imatrix in runs:
        name = f"llama.cpp {qtype}" + (" + imatrix" if with_imatrix else "")
        path = args.work / f"smollm2-{qtype.lower()}{'-imatrix' if with_imatrix else ''}.gguf"
        extra = ["--imatrix", str(imatrix)] if with_imatrix else []
        seconds, _ = run_tool([str(tools["llama-quantize"]), "--allow-requantize", "--pure", "--token-embedding-type",
                            "f32", *extra, str(source), str(path), qtype, str(args.threads)])
        files[name] = (path, seconds + (imatrix_s if with_imatrix else 0.0))
        print(f"{name}: {path.stat().st_size / 2**20:.1f} MB in {seconds:.1f} s", flush=True)

    base, tokenizer = lq.load_model("smollm2-135m")
    windows = make_windows(tokenizer, load_text("wikitext2"), 512, args.max_windows)
    files |= {name: (path, None) for name, path in ours.items()}
    models = {name: lq.load_model(str(path))[0] for name, (path, _) in files.items()}
    metrics = evaluate_windows({"fp32": base, **models}, windows, reference="fp32")
    base_ppl = metrics["fp32"]["ppl"]
    rows = [{"name": "fp32", "ppl": base_ppl}]
    test_file = args.work / "wiki.test.raw"
    test_file.write_text(load_text("wikitext2").text)
    for name, (path, seconds) in files.items():
        m = metrics[name]
        rows.append(m | {"name": name, "file": path.name, "bits_per_weight": block_bits_per_weight(path),
                         "quantize_s": seconds, "ppl_delta_pct": 100 * (m["ppl"] / base_ppl - 1),
                         "top1_pct": 100 * m["top1"], "ours": name in ours})
        if args.llama_perplexity_chunks:
            rows[-1]["llama_perplexity"] = llama_perplexity(tools["llama-perplexity"], path, test_file,
                                                            args.llama_perplexity_chunks, threads)
    if args.llama_perplexity_chunks:
        rows[0]["llama_perplexity"] = llama_perplexity(tools["llama-perplexity"], source, test_file,
                                                       args.llama_perplexity_chunks, threads)
    print(markdown_table(rows, COLUMNS))
    protocol = windows.protocol | {
        "max_windows": args.max_windows, "source": source.name, "calib": calib_text.description,
        "calib_sha256": calib_text.sha256, "calib_chunks": args.calib_chunks, "calib_seqlen": 512,
        "quantize_flags": "--allow-requantize --pure --token-embedding-type f32", "threads": args.threads,
        "llama_perplexity_chunks": args.llama_perplexity_chunks,
        "torch_threads": torch.get_num_threads()}
    write_records(args.out, Record.new("peer_llama_quantize", "smollm2-135m",
                                       {"rows": rows, "imatrix_s": imatrix_s}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
