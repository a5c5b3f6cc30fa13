"""Text sources for calibration and evaluation: a local file, WikiText-2 from the hub, or self-generated text."""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llmeasyquant.errors import DataError
from llmeasyquant.hub import hub_reachable

log = logging.getLogger(__name__)

WIKITEXT_NAMES = ("wikitext2", "wikitext-2", "wikitext")


@dataclass(frozen=True)
class TextSource:
    text: str
    description: str  # what a reader of the results needs to know, e.g. "file wiki.test.raw"
    path: str | None = None
    sha256: str = ""  # of the file's bytes for a file (identifies the data set), else of the UTF-8 text

    def __post_init__(self) -> None:
        if not self.sha256:
            object.__setattr__(self, "sha256", hashlib.sha256(self.text.encode("utf-8")).hexdigest())


def read_text_file(path: str | Path) -> TextSource:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"text file {path} does not exist; pass an existing file with --text")
    data = path.read_bytes()
    try:
        # Read as Python reads text files (universal newlines: CRLF -> LF), as the peers' published figures do.
        text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()
    except UnicodeDecodeError as exc:
        raise DataError(f"text file {path} is not UTF-8 text: {exc}") from exc
    if not text.strip():
        raise DataError(f"text file {path} is empty; give a file with enough text for at least one window")
    return TextSource(text=text, description=f"file {path.name}", path=str(path.resolve()),
                      sha256=hashlib.sha256(data).hexdigest())


def wikitext2_from_hub(split: str = "test") -> TextSource | None:
    """WikiText-2 raw from the hub, or None (with the reason logged) when `datasets` or the network is missing."""
    try:
        import datasets
    except ImportError:
        log.info("WikiText-2 from the hub needs the 'hub' extra (pip install 'llmeasyquant[hub]')")
        return None
    if not hub_reachable():
        return None
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as exc:
        log.info("could not load WikiText-2 from the hub: %s", exc)
        return None
    return TextSource(text="".join(rows["text"]), description=f"WikiText-2 raw {split} (hub)")


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer: object, tokens: int, seed: int = 0,
                  batch: int = 8) -> TextSource:
    """Text sampled from the (unquantized) model itself, starting from BOS: an offline stand-in for a corpus."""
    per_row = -(-tokens // batch) + 16
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    prompt = torch.full((batch, 1), start, dtype=torch.long)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=50,
                             temperature=1.0, max_new_tokens=per_row, min_new_tokens=per_row,
                             pad_token_id=tokenizer.eos_token_id)
    finally:
        torch.random.set_rng_state(generator_state)
    text = "\n\n".join(tokenizer.decode(row[1:], skip_special_tokens=True) for row in out)
    return TextSource(text=text, description=f"self-generated ({batch}x{per_row} tokens sampled, seed {seed})")


def resolve_text(spec: str | None, model: torch.nn.Module, tokenizer: object, tokens_needed: int,
                 seed: int = 0) -> TextSource:
    """A file path; 'wikitext2' (hub); 'self'; or None: WikiText-2 from the hub if reachable, else self-generated."""
    if spec is not None and spec.lower() not in WIKITEXT_NAMES and spec.lower() != "self":
        return read_text_file(spec)
    if spec is None or spec.lower() in WIKITEXT_NAMES:
        source = wikitext2_from_hub("test")
        if source is not None:
            return source
        if spec is not None:
            raise DataError("WikiText-2 is not reachable on the hub from here; pass a local copy with --text PATH")
        log.warning("no evaluation text given and WikiText-2 is not reachable: using text the unquantized model "
                    "generates (pass --text PATH for a real corpus)")
    return generate_text(model, tokenizer, tokens_needed, seed)


def tokenize(tokenizer: object, text: str) -> torch.Tensor:
    """The whole text as one row of token ids, without BOS or any other special token."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() == 0:
        raise DataError("the text gives no tokens; give a non-empty text")
    return ids


def consecutive_chunks(ids: torch.Tensor, seqlen: int, count: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, seqlen] from the start of `ids`; the last partial window is dropped."""
    if seqlen < 2:
        raise DataError(f"window length must be at least 2 tokens, got {seqlen}")
    available = ids.numel() // seqlen
    if available == 0:
        raise DataError(f"the text has {ids.numel()} tokens, fewer than one window of {seqlen}; "
                        "give a longer text or a smaller --seqlen")
    n = available if count is None else min(count, available)
    return ids[: n * seqlen].reshape(n, seqlen)


# Evaluation splits by the sha256 of their files: calibrating on one of them would flatter every result.
EVALUATION_SPLITS = {
    "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c": "WikiText-2 raw test",
}


def calibration_ids(spec: str, model: torch.nn.Module, tokenizer: object, samples: int = 64, seqlen: int = 512,
                    seed: int = 0) -> tuple[torch.Tensor, TextSource]:
    """Calibration token ids [samples, seqlen]: the first consecutive chunks of a text.

    `spec` is a text file, 'wikitext2' (validation split from the hub) or 'self' (text the model generates).
    """
    if samples <= 0:
        raise DataError(f"the number of calibration samples must be positive, got {samples}")
    if spec.lower() in WIKITEXT_NAMES:
        source = wikitext2_from_hub("validation")
        if source is None:
            raise DataError("WikiText-2 is not reachable on the hub from here; pass a local copy of its validation "
                            "split with --calib PATH (e.g. ../shared/data/wikitext-2/valid.txt)")
    elif spec.lower() == "self":
        source = generate_text(model, tokenizer, samples * seqlen + 1, seed)
    else:
        source = read_text_file(spec)
    if source.sha256 in EVALUATION_SPLITS:
        raise DataError(f"{source.description} is the {EVALUATION_SPLITS[source.sha256]} split, used for evaluation; "
                        "calibrating on it is refused. Use a training or validation split")
    ids = consecutive_chunks(tokenize(tokenizer, source.text), seqlen, samples)
    if ids.shape[0] < samples:
        log.warning("%s gives only %d calibration samples of %d tokens (asked for %d)", source.description,
                    ids.shape[0], seqlen, samples)
    return ids, source
