"""`llmeasyquant generate` and `chat` in-process on the tiny chat model: the streamed text is the engine's, the
usage goes to stderr, options are checked before the model loads; and `serve`'s own start-up errors."""

from __future__ import annotations

import importlib.util
import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, run
from llmeasyquant.cli.chat import fit_conversation
from llmeasyquant.cli.generate import stream_to
from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.requests import SamplingParams, TokenEvent
from serving_helpers import make_chat_folder

pytestmark = pytest.mark.timeout(120)

PROMPT = "The quick brown fox"
KV = ["--kv-memory", "8"]  # the CLI's engines and the reference engine below share it: same cache, same tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    engine = Engine.load(str(folder), EngineConfig(kv_memory_mb=8))
    yield engine
    engine.shutdown(grace_s=5)


def greedy(engine: Engine, prompt: str | list[int], max_tokens: int, **options: object):
    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **options))


# generate --------------------------------------------------------------------------------------------------------


def test_generate_prints_the_engines_greedy_text_and_the_usage(capsys, folder: Path, engine: Engine) -> None:
    code, out, err = run(capsys, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 12, *KV)
    assert code == 0, err
    expected = greedy(engine, PROMPT, 12)
    assert out == expected.text + "\n"
    usage = [line for line in err.splitlines() if "generated tokens" in line]
    assert usage == [line for line in usage if line.startswith(
        f"{expected.prompt_tokens} prompt + {expected.completion_tokens} generated tokens")]
    assert len(usage) == 1 and f"finish: {expected.finish_reason}" in usage[0]


def test_generate_stop_strings_and_seeded_sampling(capsys, folder: Path, engine: Engine) -> None:
    text = greedy(engine, PROMPT, 20, ignore_eos=True).text
    stop = text[4:6]
    code, out, _ = run(capsys, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 20, "--ignore-eos",
                       "--stop", stop, "--stop", "never-there", *KV)
    assert code == 0
    assert out == text[: text.find(stop)] + "\n"
    sampled = [run(capsys, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 10, "--temperature", 0.9,
                   "--top-k", 20, "--top-p", 0.95, "--seed", 7, *KV)[1] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_generate_with_penalties_prints_the_engines_text(capsys, folder: Path, engine: Engine) -> None:
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    code, out, err = run(capsys, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 16, "--ignore-eos",
                         "--presence-penalty", 0.5, "--frequency-penalty", 1.5, *KV)
    assert code == 0, err
    expected = greedy(engine, PROMPT, 16, ignore_eos=True, **penalties).text
    assert out == expected + "\n"
    assert expected != greedy(engine, PROMPT, 16, ignore_eos=True).text  # the penalties changed the text


@pytest.mark.parametrize(("option", "value"), [("--temperature", "3"), ("--top-p", "0"), ("--top-k", "-1"),
                                               ("--max-new-tokens", "0"), ("--presence-penalty", "2.5"),
                                               ("--frequency-penalty", "-3")])
def test_generate_refuses_options_out_of_range(capsys, option: str, value: str) -> None:
    # The model does not exist: the option must fail first, before anything is loaded.
    code, _, err = run(capsys, "generate", "no-such-model", "--prompt", "x", option, value)
    assert_one_line_error(code, err, option)


@pytest.mark.parametrize(("options", "named"), [(["--max-running", "0"], "--max-running"),
                                              (["--kv-memory", "0"], "--kv-memory"),
                                              (["--max-context", "99999"], "--max-context")])
def test_engine_options_out_of_range_name_the_option(capsys, folder: Path, options: list[str], named: str) -> None:
    code, _, err = run(capsys, "generate", folder, "--prompt", "x", *options)
    assert_one_line_error(code, err, named)


def test_generate_names_a_prompt_past_the_context(capsys, folder: Path) -> None:
    code, _, err = run(capsys, "generate", folder, "--prompt", PROMPT * 40, "--max-context", 32, *KV)
    assert_one_line_error(code, err, "context")


class _Recorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(f"write {text}")
        return super().write(text)

    def flush(self) -> None:
        self.calls.append("flush")


def test_each_piece_is_flushed_as_it_comes() -> None:
    events = [TokenEvent("Hel", (5,), 3, 1), TokenEvent("", (6,), 3, 2), TokenEvent("lo", (7,), 3, 3),
              TokenEvent("!", (8,), 3, 4, "length")]
    out = _Recorder()
    text, last, first = stream_to(out, iter(events), start_s=0.0)  # type: ignore[arg-type]
    assert text == "Hello!" and last.finish_reason == "length" and first is not None
    assert out.calls == ["write Hel", "flush", "write lo", "flush", "write !", "flush", "write \n", "flush"]


# chat ------------------------------------------------------------------------------------------------------------


def test_chat_keeps_the_conversation(capsys, monkeypatch: pytest.MonkeyPatch, folder: Path,
                                     engine: Engine) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n\nand the river?\n/exit\nnever read\n"))
    code, out, err = run(capsys, "chat", folder, "--system", "Be brief.", "--max-new-tokens", 8, *KV)
    assert code == 0, err
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    first = greedy(engine, engine.chat_prompt(conversation), 8).text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "and the river?"}]
    second = greedy(engine, engine.chat_prompt(conversation), 8).text
    assert out == f"{first}\n{second}\n"
    assert sum("generated tokens" in line for line in err.splitlines()) == 2


def test_chat_ends_at_the_end_of_input_and_goes_on_past_a_message_too_long(capsys, monkeypatch: pytest.MonkeyPatch,
                                                                            folder: Path) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{PROMPT * 30}\nhello\n"))
    code, out, err = run(capsys, "chat", folder, "--max-new-tokens", 4, "--max-context", 48, *KV)
    assert code == 0, err
    assert "llmeasyquant: the prompt has" in err  # the long message is refused, the chat goes on
    assert sum("generated tokens" in line for line in err.splitlines()) == 1
    assert out.endswith("\n") and out.count("\n") >= 1


def test_chat_needs_a_chat_template(capsys, monkeypatch: pytest.MonkeyPatch, llama_folder: Path) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    code, _, err = run(capsys, "chat", llama_folder, *KV)
    assert_one_line_error(code, err, "chat template")


class _CountingEngine:
    """chat_prompt as one token per character of content, over a context of 40."""

    max_context = 40

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return [0] * sum(len(m["content"]) for m in messages)


def test_a_conversation_past_the_context_drops_its_oldest_exchanges() -> None:
    messages = [{"role": "system", "content": "s" * 5}]
    for turn in range(3):
        messages += [{"role": "user", "content": f"u{turn}" * 4}, {"role": "assistant", "content": f"a{turn}" * 4}]
    messages.append({"role": "user", "content": "last"})
    ids = fit_conversation(_CountingEngine(), messages)  # type: ignore[arg-type]
    assert len(ids) < 40
    assert messages[0]["content"] == "s" * 5 and messages[-1]["content"] == "last"
    assert [m["content"][:2] for m in messages[1:-1]] == ["u2", "a2"]


# serve: what fails before it listens -----------------------------------------------------------------------------


def test_serve_without_the_extra_says_which_to_install(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    code, _, err = run(capsys, "serve", "no-such-model")
    assert_one_line_error(code, err, "uvicorn", "llmeasyquant[serve]")


def test_serve_on_a_port_in_use_is_a_one_line_error(capsys, folder: Path) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = run(capsys, "serve", folder, "--port", port, *KV)
    assert_one_line_error(code, err, f"127.0.0.1:{port}", "--port")
