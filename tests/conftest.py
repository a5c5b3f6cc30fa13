"""Shared fixtures: tiny random models (llama, gpt2), an offline tokenizer, a model folder and a real text.

Everything here is built in code from configs: no downloads, no network, milliseconds per model.
"""

from __future__ import annotations

import os
import shutil
import site
import string
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from llmeasyquant.texts import shipped_bytes

VOCAB = 256
BOS_ID, EOS_ID = 1, 2
WIKITEXT_BYTES = 40_000

TOKENIZER_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A tokenizer for the tests of a quantization library is trained on
this short text, in code, so that no file has to be downloaded. The river flows through the valley and the town
was built on both of its banks in the nineteenth century. He played for the club in the season of 1998, when the
team won the league and the cup. The album was released in the United States and reached number one on the chart.
"""


# Files opened in a folder beside the checkout (such as a team's shared data folder), by any code a test runs,
# however the path was built. Not counted: hidden folders (~/.cache and the like, when the checkout sits in a home
# folder), the interpreter's own folders (a virtual environment may sit beside the checkout) and the scratch folders
# of pytest and tempfile (a checkout may sit in the temporary folder). An audit hook cannot be removed, so it only
# appends; each test checks what it added.
_CHECKOUT = Path(__file__).resolve().parent.parent
_INTERPRETER = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages())}
_TEMP = Path(tempfile.gettempdir()).resolve()
_OUTSIDE_OPENS: list[str] = []


def _beside_the_checkout(path: Path) -> bool:
    if not path.is_relative_to(_CHECKOUT.parent) or path.is_relative_to(_CHECKOUT):
        return False
    if path.relative_to(_CHECKOUT.parent).parts[0].startswith("."):
        return False
    if any(path.is_relative_to(root) for root in _INTERPRETER):
        return False
    scratch = path.relative_to(_TEMP).parts[:1] if path.is_relative_to(_TEMP) else ()
    return not (scratch and scratch[0].startswith(("pytest-of-", "tmp")))


def _audit_outside_opens(event: str, args: tuple) -> None:
    if event != "open" or not isinstance(args[0], str | bytes | os.PathLike):
        return
    path = Path(os.path.abspath(os.fsdecode(args[0])))
    if _beside_the_checkout(path):
        _OUTSIDE_OPENS.append(str(path))


sys.addaudithook(_audit_outside_opens)


@pytest.fixture(autouse=True)
def _nothing_read_beside_the_checkout():
    """A user's clone has nothing beside it: a test that reads there passes only on the team's machines."""
    before = len(_OUTSIDE_OPENS)
    yield
    opened = _OUTSIDE_OPENS[before:]
    assert not opened, f"opened outside the repository (ship the file instead): {sorted(set(opened))[:5]}"


def _seeded(build: Callable[[], torch.nn.Module], marker: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build()
    model.eval()
    model.llmeasyquant_source = marker
    return model


def llama_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                       tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)


def gpt2_config() -> GPT2Config:
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=BOS_ID,
                      eos_token_id=EOS_ID)


def build_model(kind: str) -> torch.nn.Module:
    """A tiny random model of the given family, seeded, in eval mode, with a source marker."""
    if kind == "llama":
        return _seeded(lambda: LlamaForCausalLM(llama_config()), "tiny-random-llama")
    if kind == "gpt2":
        return _seeded(lambda: GPT2LMHeadModel(gpt2_config()), "tiny-random-gpt2")
    raise ValueError(kind)


def save_hf_folders(root: Path, tokenizer: object, dtype: torch.dtype | None = None) -> dict[str, Path]:
    """Hugging Face folders of the tiny llama (own head) and gpt2 (tied head) under `root`, in `dtype` if given."""
    paths = {}
    for kind in ("llama", "gpt2"):
        paths[kind] = root / kind
        model = build_model(kind)
        (model if dtype is None else model.to(dtype)).save_pretrained(paths[kind])
        tokenizer.save_pretrained(paths[kind])
    return paths


@pytest.fixture(autouse=True)
def _fixed_kernel_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's first supporting kernel, for every row count: tests that name the kernel they expect stay
    reproducible. The measured choice (kernels/choice.py) is tested on its own in kernels/test_choice.py."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "first")


@pytest.fixture(scope="session")
def make_model() -> Callable[[str], torch.nn.Module]:
    """Factory: make_model('llama' | 'gpt2') gives a fresh tiny random model each call (identical weights)."""
    return build_model


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    return build_model("llama")


@pytest.fixture
def tiny_gpt2() -> GPT2LMHeadModel:
    return build_model("gpt2")


@pytest.fixture(params=["llama", "gpt2"])
def model_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def random_ids() -> torch.Tensor:
    """Token ids [4, 32] from a fixed generator (does not touch the global RNG)."""
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1234))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer (vocab <= 256) trained in code; it adds BOS when asked for special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=[*string.printable.strip(), "▁"])
    tok.train_from_iterator([TOKENIZER_TRAINING_TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert fast.bos_token_id == BOS_ID and fast.eos_token_id == EOS_ID
    assert len(fast) <= VOCAB
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast) -> Path:
    """The tiny llama saved as a Hugging Face folder with its tokenizer: loadable by load_model() and the CLI.

    Shared by the session; tests must only read it.
    """
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    build_model("llama").save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _wikitext_snippet() -> bytes:
    data = shipped_bytes("wikitext2", "test")[0][:WIKITEXT_BYTES]
    return data[: data.rfind(b"\n") + 1]  # whole lines: valid UTF-8, no split character


@pytest.fixture
def wiki_text(tmp_path: Path) -> Path:
    """The first ~40 KB (whole lines) of the shipped WikiText-2 raw test, as a file in tmp_path."""
    path = tmp_path / "wiki.txt"
    path.write_bytes(_wikitext_snippet())
    return path


@pytest.fixture(scope="module")
def wiki_text_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same text as `wiki_text`, for module-scoped fixtures."""
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_bytes(_wikitext_snippet())
    return path


@pytest.fixture
def calib_text(wiki_text: Path, tmp_path: Path) -> Path:
    """Calibration text that is not the evaluation text: the second half of the snippet."""
    path = tmp_path / "calib.txt"
    text = wiki_text.read_text()
    path.write_text(text[len(text) // 2:])
    return path


@pytest.fixture(scope="module")
def ops():
    """The fused C++ operators (kernels/native.py); the test is skipped where no compiler can build them."""
    from llmeasyquant.kernels import native

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the fused operators cannot be built")
    built = native.ops()
    assert built is not None, "a compiler is present, so the fused operators must build (see the log for why not)"
    return built
