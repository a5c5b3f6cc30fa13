"""Text sources for calibration and evaluation: a shipped text by name, a file, the hub, or self-generated text.

A spec is resolved in this order: 'self' (text the unquantized model samples; only when asked for by name), a shipped
name ('wikitext2', the default: see llmeasyquant.texts), 'hub:DATASET[:CONFIG]' (the `datasets` library; only when
asked for by name), else a file path. The split follows the role: evaluation reads 'test', calibration 'validation'.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from llmeasyquant import texts
from llmeasyquant.errors import DataError
from llmeasyquant.infra.hub import hub_reachable

log = logging.getLogger(__name__)

DEFAULT_TEXT = "wikitext2"  # evaluation and calibration text when none is given: shipped, so it works offline
SELF_TEXT = "self"
HUB_PREFIX = "hub:"
TEXT_SPECS = "a file path, a shipped text (wikitext2, pyref), 'hub:DATASET[:CONFIG]' or 'self'"

TextKind = Literal["shipped", "file", "hub", "self-generated"]


@dataclass(frozen=True)
class TextSource:
    text: str
    description: str  # what a reader of the results needs to know, e.g. "WikiText-2 raw test (shipped ...)"
    kind: TextKind = "file"
    path: str | None = None
    sha256: str = ""  # of the file's bytes for a file (identifies the data set), else of the UTF-8 text

    def __post_init__(self) -> None:
        if not self.sha256:
            object.__setattr__(self, "sha256", hashlib.sha256(self.text.encode("utf-8")).hexdigest())


def _decode(data: bytes, where: str) -> str:
    try:
        # Read as Python reads text files (universal newlines: CRLF -> LF), as the peers' published figures do.
        text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()
    except UnicodeDecodeError as exc:
        raise DataError(f"{where} is not UTF-8 text: {exc}") from exc
    if not text.strip():
        raise DataError(f"{where} is empty; give a text with enough tokens for at least one window")
    return text


def read_text_file(path: str | Path) -> TextSource:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"text file {path} does not exist; give {TEXT_SPECS}")
    data = path.read_bytes()
    return TextSource(text=_decode(data, f"text file {path}"), description=f"file {path.name}", kind="file",
                      path=str(path.resolve()), sha256=hashlib.sha256(data).hexdigest())


def shipped_text(name: str, split: texts.Split) -> TextSource:
    """A text shipped inside the package (checked against its sha256)."""
    data, entry = texts.shipped_bytes(name, split)
    return TextSource(text=_decode(data, entry.file), description=entry.description, kind="shipped",
                      sha256=entry.sha256)


def text_from_hub(spec: str, split: texts.Split) -> TextSource:
    """'DATASET[:CONFIG]' from the Hugging Face hub, its 'text' column joined; DataError when it cannot be had."""
    dataset, _, config = spec.partition(":")
    if not dataset:
        raise DataError(f"'{HUB_PREFIX}{spec}' names no data set; write e.g. hub:wikitext:wikitext-103-raw-v1")
    try:
        import datasets
    except ImportError:
        raise DataError("text from the hub needs the 'hub' extra: pip install 'llmeasyquant[hub]'") from None
    if not hub_reachable():
        raise DataError(f"the hub is not reachable from here, so {HUB_PREFIX}{spec} cannot be read; give a local "
                        f"file, or a shipped text ({', '.join(texts.shipped_names())})")
    try:
        rows = datasets.load_dataset(dataset, config or None, split=split)
    except Exception as exc:  # datasets raises many types (network, missing split, bad config)
        raise DataError(f"could not load {split} split of {HUB_PREFIX}{spec} from the hub: {exc}") from exc
    if "text" not in rows.column_names:
        raise DataError(f"{HUB_PREFIX}{spec} has no 'text' column (it has {', '.join(rows.column_names)})")
    return TextSource(text="".join(rows["text"]), description=f"{dataset} {config} {split} (hub)".replace("  ", " "),
                      kind="hub")


def load_text(spec: str | None, split: texts.Split = "test") -> TextSource:
    """A shipped text by name (the default: WikiText-2), 'hub:DATASET[:CONFIG]', or a file path."""
    spec = DEFAULT_TEXT if spec is None else str(spec)
    if texts.is_shipped(spec):
        return shipped_text(spec, split)
    if spec.lower().startswith(HUB_PREFIX):
        return text_from_hub(spec[len(HUB_PREFIX):], split)
    if spec.lower() == SELF_TEXT:
        raise DataError("'self' (text the model generates) needs the model; it is resolved by resolve_text")
    if not Path(spec).expanduser().exists() and Path(spec).name == spec and not Path(spec).suffix:
        raise DataError(f"no shipped text and no file is named {spec!r}; give {TEXT_SPECS}")
    return read_text_file(spec)


@torch.no_grad()
def generate_text(model: torch.nn.Module, tokenizer: object, tokens: int, seed: int = 0,
                  batch: int = 8) -> TextSource:
    """Text sampled from the (unquantized) model itself, starting from BOS. Only on request: a model scoring its own
    samples says little about how well it models real text."""
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
    return TextSource(text=text, description=f"self-generated by the unquantized model ({batch}x{per_row} tokens "
                      f"sampled, seed {seed})", kind="self-generated")


def resolve_text(spec: str | None, model: torch.nn.Module, tokenizer: object, tokens_needed: int,
                 seed: int = 0, split: texts.Split = "test") -> TextSource:
    """`load_text`'s sources, plus 'self': text the model generates, made only when asked for by name."""
    if spec is not None and str(spec).lower() == SELF_TEXT:
        log.warning("evaluating on text the unquantized model generates itself (--text self): the figures say how "
                    "the model scores its own samples, not real text")
        return generate_text(model, tokenizer, tokens_needed, seed)
    return load_text(spec, split)


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


def calibration_ids(spec: str | None, model: torch.nn.Module, tokenizer: object, samples: int = 64,
                    seqlen: int = 512, seed: int = 0) -> tuple[torch.Tensor, TextSource]:
    """Calibration token ids [samples, seqlen]: the first consecutive chunks of a text.

    `spec` is a file, a shipped text ('wikitext2', the default: its validation split), 'hub:DATASET[:CONFIG]'
    (validation split) or 'self' (text the model generates).
    """
    if samples <= 0:
        raise DataError(f"the number of calibration samples must be positive, got {samples}")
    source = resolve_text(spec, model, tokenizer, samples * seqlen + 1, seed, split="validation")
    if source.sha256 in texts.EVALUATION_SHA256:
        raise DataError(f"{source.description} is the {texts.EVALUATION_SHA256[source.sha256]} split, used for "
                        "evaluation; calibrating on it is refused. Use a training or validation split (--calib "
                        "wikitext2 gives WikiText-2 validation)")
    ids = consecutive_chunks(tokenize(tokenizer, source.text), seqlen, samples)
    if ids.shape[0] < samples:
        log.warning("%s gives only %d calibration samples of %d tokens (asked for %d)", source.description,
                    ids.shape[0], seqlen, samples)
    return ids, source
