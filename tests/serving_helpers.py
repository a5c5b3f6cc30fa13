"""A tiny chat model folder for the serving tests (the server, generate and chat), and reading what a server says."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from conftest import build_tokenizer, llama_config

# A plain template the tiny tokenizer can spell: the engine only needs the tokenizer to have one.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_POSITIONS = 4096  # long enough for a request that is still decoding when a test disconnects or stops the server


def make_chat_folder(folder: Path) -> Path:
    """The tiny random llama (2 layers, 64 wide) with a chat template, saved as a Hugging Face folder."""
    config = llama_config()
    config.max_position_embeddings = MAX_POSITIONS
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def sse_payloads(text: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order (comments and pings left out)."""
    return [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]


def sse_chunks(text: str) -> tuple[list[dict], str]:
    """The JSON chunks of a stream and its last payload (which must be [DONE])."""
    payloads = sse_payloads(text)
    return [json.loads(p) for p in payloads[:-1]], payloads[-1]


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def requests_by(samples: dict[tuple[str, tuple], float], outcome: str) -> float:
    return samples["llmeasyquant_requests_total", (("outcome", outcome),)]
