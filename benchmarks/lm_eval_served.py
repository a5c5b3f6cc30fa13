"""lm-evaluation-harness against our server: its `local-completions` model on `llmeasyquant serve`, beside its
own `hf` model on the same weights, on three local tasks (log-likelihood, rolling perplexity, generation).

    python benchmarks/lm_eval_served.py --lm-eval PATH/TO/lm_eval [--serve smollm2-135m[,CHECKPOINT...]]
        [--kv float32] [--work out/lm_eval] [--out benchmarks/results/lm_eval_served.json]

lm-evaluation-harness is not a dependency of this project: install it apart (for instance `python -m venv
/tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 "lm_eval[api]" transformers accelerate`) and pass its
`lm_eval` executable. Protocol: the tasks (benchmarks/lm_eval_tasks/) are `facts_local` (24 multiple-choice
completions, acc and acc_norm), `wiki_local` (12 paragraphs of WikiText-2 raw test longer than 400 characters,
rolling log-likelihood: word and byte perplexity) and `qa_local` (4 questions, greedy generation until a newline,
exact match); zero-shot, batch size 8, offline. The reference row is lm_eval's `hf` model on the bundled
SmolLM2-135M-Instruct saved as a Hugging Face folder (float32, CPU); each served row starts `llmeasyquant --threads
2 serve MODEL` on a free loopback port (KV cache `--kv`), runs lm_eval's `local-completions` against it with the
server's own tokenizer (lm_eval finds /tokenizer_info and /tokenize and uses them; token-id requests: `echo`,
`logprobs` 1, `max_tokens` 1 for log-likelihoods), and stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmeasyquant.calibration.data import load_text
from llmeasyquant.models.load import load_model
from llmeasyquant.record import Record, write_records
from llmeasyquant.report.tables import markdown_table
from serving import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "--threads", "2"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
QUESTIONS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
             ("What is two plus two?", "4"), ("What color is the sky on a clear day?", "Blue")]
METRICS = {"facts_local": ("acc", "acc_norm"), "wiki_local": ("word_perplexity", "byte_perplexity"),
           "qa_local": ("exact_match",)}
COLUMNS = (("model", "model", ""), ("facts acc", "facts_local/acc", ".4f"),
           ("facts acc_norm", "facts_local/acc_norm", ".4f"), ("wiki word ppl", "wiki_local/word_perplexity", ".4f"),
           ("wiki byte ppl", "wiki_local/byte_perplexity", ".5f"), ("qa exact", "qa_local/exact_match", ".2f"),
           ("qa answers as the reference's", "qa_same", ""))


def write_tasks(folder: Path) -> None:
    """The three task YAML files and their data, in `folder` (lm_eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmarks" / "lm_eval_tasks" / "facts.jsonl", folder / "facts.jsonl")
    paragraphs = [p.strip() for p in load_text("wikitext2").text.split("\n") if len(p.strip()) > 400][:12]
    (folder / "wiki.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    (folder / "qa.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (folder / "facts.yaml").write_text(
        "task: facts_local\n" + data.format(path=folder / "facts.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    (folder / "wiki.yaml").write_text(
        "task: wiki_local\n" + data.format(path=folder / "wiki.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n")
    (folder / "qa.yaml").write_text(
        "task: qa_local\n" + data.format(path=folder / "qa.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "Question:"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n    ignore_case: true\n"
        "    ignore_punctuation: true\n")


def hf_folder(folder: Path) -> Path:
    """The bundled model as a Hugging Face folder (float32) that lm_eval's `hf` model loads."""
    if not (folder / "config.json").exists():
        model, tokenizer = load_model("smollm2-135m")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        config.pop("quantization_config", None)  # the GGUF loader's note: the weights saved are plain float32
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_lm_eval(lm_eval: str, model_args: list[str], tasks: Path, out: Path) -> dict:
    """lm_eval's results of the three tasks: {task/metric: value}, its version under "lm_eval", and the
    generation task's answers under "qa_answers"."""
    command = [lm_eval, "run", *model_args, "--tasks", ",".join(METRICS), "--include_path", str(tasks),
               "--batch_size", "8", "--output_path", str(out), "--log_samples"]
    subprocess.run(command, check=True, env=os.environ | OFFLINE, timeout=3600)
    newest = lambda pattern: max(out.rglob(pattern), key=lambda p: p.stat().st_mtime)  # noqa: E731
    record = json.loads(newest("results_*.json").read_text())
    samples = [json.loads(line) for line in newest("samples_qa_local_*.jsonl").read_text().splitlines()]
    answers = [sample["resps"][0][0] for sample in sorted(samples, key=lambda sample: sample["doc_id"])]
    return {"lm_eval": record["lm_eval_version"], "qa_answers": answers,
            **{f"{task}/{metric}": record["results"][task][f"{metric},none"] for task, names in METRICS.items()
               for metric in names}}


def served_row(lm_eval: str, model: str, kv: str, tasks: Path, out: Path) -> dict:
    port = free_port()
    cache = ["--kv-dtype", kv] if kv.startswith("float") else ["--kv-bits", kv]
    server = Server([*CLI, "serve", model, "--port", str(port), "--served-model-name", "served", *cache], port)
    try:
        args = (f"model=served,base_url=http://127.0.0.1:{port}/v1/completions,tokenized_requests=True,"
                "num_concurrent=1,max_retries=1")
        return run_lm_eval(lm_eval, ["--model", "local-completions", "--model_args", args], tasks, out)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable (installed apart)")
    parser.add_argument("--serve", default="smollm2-135m", help="models or checkpoints to serve, comma-separated")
    parser.add_argument("--kv", default="float32", help="the served KV cache: float32, float16 or bits (2, 3, 4, 8)")
    parser.add_argument("--work", type=Path, default=Path("out/lm_eval"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval_served.json"))
    args = parser.parse_args()
    work = args.work.resolve()
    tasks = work / "tasks"
    write_tasks(tasks)
    folder = hf_folder(work / "smollm2-hf")
    rows = [{"model": "lm_eval hf, SmolLM2-135M float32 (reference)",
             **run_lm_eval(args.lm_eval, ["--model", "hf", "--model_args", f"pretrained={folder},dtype=float32",
                                          "--device", "cpu"], tasks, work / "hf")}]
    for index, model in enumerate(args.serve.split(",")):
        scores = served_row(args.lm_eval, model, args.kv, tasks, work / f"served{index}")
        rows.append({"model": f"lm_eval local-completions on llmeasyquant serve {model} (KV {args.kv})", **scores})
    for row in rows:
        row["qa_same"] = "yes" if row["qa_answers"] == rows[0]["qa_answers"] else "no"
    print(markdown_table(rows, COLUMNS))
    protocol = {"tasks": list(METRICS), "batch_size": 8, "num_fewshot": 0, "kv": args.kv,
                "lm_eval": rows[0]["lm_eval"], "threads": 2}
    write_records(args.out, Record.new("lm_eval_served", args.serve, {"rows": rows}, protocol))
    return 0


if __name__ == "__main__":
    sys.exit(main())
