"""The HTTP app in-process (Starlette's TestClient) over a real engine on the tiny chat model: the OpenAI bodies,
streams, every bad input answered with an OpenAI error body (and the server still serving), auth and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="pip install -e '.[serve]'")

from fastapi.testclient import TestClient

from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.requests import EngineStopped, QueueFull, SamplingParams, TokenEvent
from llmeasyquant.serving.app import _queued, build_app
from serving_helpers import make_chat_folder, metric_samples, requests_by, sse_chunks

pytestmark = pytest.mark.timeout(120)

NAME = "tiny"
KEY = "sk-test-key"
PROMPT = "The quick brown fox"
CONTEXT = 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("serving") / "tiny-chat")


def make_engine(folder: Path) -> Engine:
    return Engine.load(str(folder), EngineConfig(kv_memory_mb=4, max_running=4, max_queue=4, prefill_chunk=64,
                                                 max_context=CONTEXT), NAME)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Engine]:
    engine = make_engine(folder)
    yield engine
    engine.shutdown(grace_s=5)


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    # The lifespan starts the engine here and shuts it down at the end of the module.
    with TestClient(build_app(engine, NAME), raise_server_exceptions=False) as client:
        yield client


def completion(prompt: object = PROMPT, **fields: object) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0} | fields


def chat(content: str = "hello there", **fields: object) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0} | fields


# answers ---------------------------------------------------------------------------------------------------------


def test_completion_is_the_engines_greedy_text_with_usage(client: TestClient, engine: Engine) -> None:
    response = client.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == NAME and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    alone = engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    assert choice["text"] == alone.text
    assert choice["finish_reason"] == alone.finish_reason
    usage = body["usage"]
    assert usage == {"prompt_tokens": alone.prompt_tokens, "completion_tokens": alone.completion_tokens,
                     "total_tokens": alone.prompt_tokens + alone.completion_tokens}


def test_a_request_without_model_is_for_the_served_one(client: TestClient) -> None:
    named = client.post("/v1/completions", json=completion()).json()
    unnamed = client.post("/v1/completions", json={k: v for k, v in completion().items() if k != "model"}).json()
    assert unnamed["model"] == NAME and unnamed["choices"] == named["choices"]
    chat_body = {k: v for k, v in chat().items() if k != "model"}
    assert client.post("/v1/chat/completions", json=chat_body).json()["choices"] == \
        client.post("/v1/chat/completions", json=chat()).json()["choices"]


def test_a_prompt_of_token_ids_and_a_list_holding_one_prompt(client: TestClient, engine: Engine) -> None:
    ids = engine.tokenizer(PROMPT)["input_ids"]
    by_ids = client.post("/v1/completions", json=completion(ids)).json()
    by_text = client.post("/v1/completions", json=completion([PROMPT])).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_chat_completion_applies_the_template(client: TestClient, engine: Engine) -> None:
    response = client.post("/v1/chat/completions", json=chat(max_completion_tokens=6, max_tokens=None))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    ids = engine.chat_prompt([{"role": "user", "content": "hello there"}])
    alone = engine.generate(ids, SamplingParams(max_tokens=6, temperature=0.0))
    assert choice["message"]["content"] == alone.text
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == alone.completion_tokens <= 6


def test_stream_chunks_add_up_to_the_whole_answer(client: TestClient) -> None:
    whole = client.post("/v1/completions", json=completion(max_tokens=12)).json()
    response = client.post("/v1/completions", json=completion(max_tokens=12, stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks, last = sse_chunks(response.text)
    assert last == "[DONE]"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_usage_comes_last_when_asked_for(client: TestClient) -> None:
    whole = client.post("/v1/chat/completions", json=chat()).json()
    response = client.post("/v1/chat/completions",
                           json=chat(stream=True, stream_options={"include_usage": True}))
    chunks, last = sse_chunks(response.text)
    assert last == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    *answer, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in answer) == \
        whole["choices"][0]["message"]["content"]
    assert answer[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_models_health_and_the_model_card(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["object"] == "list"
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == NAME


# logit_bias, penalties, log probabilities, n --------------------------------------------------------------------


def greedy(engine: Engine, prompt: str | list[int], max_tokens: int, **options: object):
    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                  **options))


def streamed_logprobs(chunks: list[dict], index: int = 0) -> dict[str, list]:
    """The completions logprobs of one choice's chunks, joined."""
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index and choice["logprobs"] is not None:
                for key, values in choice["logprobs"].items():
                    joined[key] += values
    return joined


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 4}], ids=["greedy", "seeded"])
def test_requests_without_the_new_options_answer_as_before(client: TestClient, engine: Engine,
                                                            sampling: dict) -> None:
    bare = client.post("/v1/completions", json=completion(max_tokens=10, ignore_eos=True, **sampling)).json()
    # Their defaults sent explicitly, as some clients do, change nothing either.
    explicit = client.post("/v1/completions", json=completion(
        max_tokens=10, ignore_eos=True, n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
        logprobs=None, best_of=1, **sampling)).json()
    assert explicit["choices"] == bare["choices"] and explicit["usage"] == bare["usage"]
    [choice] = bare["choices"]
    assert choice["logprobs"] is None and choice["index"] == 0
    params = SamplingParams(max_tokens=10, ignore_eos=True, **({"temperature": 0.0} | sampling))
    assert choice["text"] == engine.generate(PROMPT, params).text
    chat_bare = client.post("/v1/chat/completions", json=chat(**sampling)).json()
    chat_explicit = client.post("/v1/chat/completions", json=chat(logprobs=False, n=1, **sampling)).json()
    assert chat_explicit["choices"] == chat_bare["choices"] and chat_bare["choices"][0]["logprobs"] is None


def test_logit_bias_and_penalties_are_the_engines(client: TestClient, engine: Engine) -> None:
    [fox] = engine.tokenizer(" fox", add_special_tokens=False)["input_ids"][-1:]
    forced = client.post("/v1/completions", json=completion(max_tokens=4, ignore_eos=True,
                                                            logit_bias={str(fox): 100})).json()
    assert forced["choices"][0]["text"] == greedy(engine, PROMPT, 4, logit_bias={fox: 100.0}).text
    assert greedy(engine, PROMPT, 4, logit_bias={fox: 100.0}).token_ids == [fox] * 4
    options = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    penalised = client.post("/v1/completions", json=completion(max_tokens=16, ignore_eos=True, **options)).json()
    text = penalised["choices"][0]["text"]
    assert text == greedy(engine, PROMPT, 16, **options).text
    assert text != greedy(engine, PROMPT, 16).text  # the penalties changed the answer
    chat_text = client.post("/v1/chat/completions", json=chat(max_tokens=16, ignore_eos=True, **options)).json()
    ids = engine.chat_prompt([{"role": "user", "content": "hello there"}])
    assert chat_text["choices"][0]["message"]["content"] == greedy(engine, ids, 16, **options).text


def test_completion_logprobs_whole_and_streamed(client: TestClient, engine: Engine) -> None:
    body = completion(max_tokens=10, ignore_eos=True, logprobs=3)
    whole = client.post("/v1/completions", json=body).json()
    [choice] = whole["choices"]
    logprobs = choice["logprobs"]
    alone = greedy(engine, PROMPT, 10, logprobs=3)
    pieces = engine.token_pieces
    assert logprobs["tokens"] == [pieces.text(t) for t in alone.token_ids]
    assert logprobs["token_logprobs"] == [entry.logprob for entry in alone.logprobs]
    assert logprobs["text_offset"] == [entry.offset for entry in alone.logprobs]
    assert choice["text"] == alone.text and len(logprobs["tokens"]) == whole["usage"]["completion_tokens"] == 10
    for entry, top in zip(alone.logprobs, logprobs["top_logprobs"], strict=True):
        # The 3 likeliest, likeliest first, and the generated token always among them (OpenAI's up to logprobs+1).
        expected = {pieces.text(t): value for t, value in entry.top}
        expected.setdefault(pieces.text(entry.token), entry.logprob)
        assert top == expected and list(top.values())[:3] == sorted(list(top.values())[:3], reverse=True)
        assert 3 <= len(top) <= 4
    chunks, last = sse_chunks(client.post("/v1/completions", json=body | {"stream": True}).text)
    assert last == "[DONE]"
    assert streamed_logprobs(chunks) == logprobs
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    shown = 0
    for chunk in chunks:  # each chunk carries the log probabilities of the tokens whose text it carries
        [part] = chunk["choices"]
        shown += len(part["text"])
        assert all(offset < shown for offset in (part["logprobs"] or {}).get("text_offset", []))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["logprobs"] is None
    zero = client.post("/v1/completions", json=completion(max_tokens=3, logprobs=0)).json()["choices"][0]
    assert [list(top) for top in zero["logprobs"]["top_logprobs"]] == [[t] for t in zero["logprobs"]["tokens"]]


def test_chat_logprobs_whole_and_streamed(client: TestClient, engine: Engine) -> None:
    body = chat(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    whole = client.post("/v1/chat/completions", json=body).json()
    [choice] = whole["choices"]
    assert set(choice["logprobs"]) == {"content", "refusal"}
    content = choice["logprobs"]["content"]
    ids = engine.chat_prompt([{"role": "user", "content": "hello there"}])
    alone = greedy(engine, ids, 8, logprobs=2)
    pieces = engine.token_pieces
    assert [item["token"] for item in content] == [pieces.text(t) for t in alone.token_ids]
    assert [item["logprob"] for item in content] == [entry.logprob for entry in alone.logprobs]
    for item, entry in zip(content, alone.logprobs, strict=True):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(pieces.bytes(entry.token)) == list(item["token"].encode())
        assert [(top["token"], top["logprob"]) for top in item["top_logprobs"]] == \
            [(pieces.text(t), value) for t, value in entry.top]
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] >= item["logprob"]
    chunks, _ = sse_chunks(client.post("/v1/chat/completions", json=body | {"stream": True}).text)
    streamed = [item for c in chunks if c["choices"][0]["logprobs"] for item in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    plain = client.post("/v1/chat/completions", json=chat(max_tokens=4, logprobs=True)).json()
    assert [item["top_logprobs"] for item in plain["choices"][0]["logprobs"]["content"]] == [[]] * 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_with_a_stop_string_leave_out_the_tokens_it_cut(client: TestClient, engine: Engine,
                                                                    stream: bool) -> None:
    varied = {"frequency_penalty": 1.5, "presence_penalty": 0.5}  # the tiny model alone repeats one token
    free = greedy(engine, PROMPT, 24, logprobs=0, **varied)
    offsets = [entry.offset for entry in free.logprobs]
    k = next(i for i in range(3, 23) if offsets[i + 1] - offsets[i] >= 2 and
             free.text.index(free.text[offsets[i]:offsets[i] + 2]) == offsets[i])
    stop = free.text[offsets[k]:offsets[k] + 2]  # token k starts it: k and what follows are cut off
    body = completion(max_tokens=24, ignore_eos=True, logprobs=0, stop=stop, stream=stream, **varied)
    response = client.post("/v1/completions", json=body)
    if stream:
        chunks, _ = sse_chunks(response.text)
        text, logprobs = "".join(c["choices"][0]["text"] for c in chunks), streamed_logprobs(chunks)
    else:
        choice = response.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    assert text == free.text[:offsets[k]]
    assert logprobs["tokens"] == [engine.token_pieces.text(t) for t in free.token_ids[:k]]
    assert logprobs["text_offset"] == offsets[:k]


def test_n_choices_whole(client: TestClient) -> None:
    options = {"max_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    whole = client.post("/v1/completions", json=completion(n=3, seed=11, **options)).json()
    choices = whole["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    # Choice i is what n=1 gives with seed + i: the request repeats, and its choices differ.
    singles = [client.post("/v1/completions", json=completion(seed=11 + i, **options)).json() for i in range(3)]
    assert [c["text"] for c in choices] == [s["choices"][0]["text"] for s in singles]
    assert len({c["text"] for c in choices}) == 3
    assert whole["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]  # counted once
    assert whole["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles) == 18
    again = client.post("/v1/completions", json=completion(n=3, seed=11, **options)).json()
    assert again["choices"] == choices
    chat_whole = client.post("/v1/chat/completions", json=chat(n=2, logprobs=True)).json()
    assert [c["index"] for c in chat_whole["choices"]] == [0, 1]
    assert chat_whole["choices"][0]["message"] == chat_whole["choices"][1]["message"]  # greedy: the same twice
    assert all(len(c["logprobs"]["content"]) == chat_whole["usage"]["completion_tokens"] // 2
               for c in chat_whole["choices"])


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_n_choices_streamed_interleave_tagged_with_their_index(client: TestClient, endpoint: str) -> None:
    make = completion if endpoint == "completions" else chat
    body = make(max_tokens=8, ignore_eos=True, temperature=1.0, seed=5, n=3, logprobs=True if make is chat else 1)
    whole = client.post(f"/v1/{endpoint}", json=body).json()
    chunks, last = sse_chunks(client.post(f"/v1/{endpoint}", json=body | {
        "stream": True, "stream_options": {"include_usage": True}}).text)
    assert last == "[DONE]"
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(len(c["choices"]) == 1 for c in chunks)
    indices = [c["choices"][0]["index"] for c in chunks]
    assert set(indices) == {0, 1, 2} and indices != sorted(indices)  # interleaved as the engine decodes them
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [choice["finish_reason"]]
        if make is chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(m["delta"].get("content", "") for m in mine) == choice["message"]["content"]
            assert [i for m in mine if m["logprobs"] for i in m["logprobs"]["content"]] == \
                choice["logprobs"]["content"]
        else:
            assert "".join(m["text"] for m in mine) == choice["text"]
            assert streamed_logprobs(chunks, choice["index"]) == choice["logprobs"]


def test_several_prompts_answer_n_choices_each_in_order(client: TestClient, engine: Engine) -> None:
    texts = [PROMPT, "hello there", "one two"]
    ids = engine.tokenizer(texts[1])["input_ids"]
    body = client.post("/v1/completions", json=completion([texts[0], ids, texts[2]], n=2, max_tokens=5,
                                                           ignore_eos=True)).json()
    # Choice p * n + j is prompt p's j-th (greedy: both of a prompt's choices are alike).
    alone = [greedy(engine, prompt, 5) for prompt in (texts[0], ids, texts[2])]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [a.text for a in alone for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == sum(a.prompt_tokens for a in alone)  # each prompt once
    assert body["usage"]["completion_tokens"] == 6 * 5
    chunks, _ = sse_chunks(client.post("/v1/completions", json=completion(texts, max_tokens=5, ignore_eos=True,
                                                                          stream=True)).text)
    for index, expected in enumerate(alone):  # a string prompt and its token ids are the same prompt
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index) == \
            expected.text


def test_five_stop_strings_as_lm_evaluation_harness_sends_them(client: TestClient, engine: Engine) -> None:
    # A task's four `until` strings and the end-of-sequence text it adds: more than OpenAI's 4, as vLLM takes.
    free = greedy(engine, PROMPT, 12)
    stop = free.text[4:7]
    body = completion(max_tokens=12, ignore_eos=True, stop=["\n\n", "Question:", "</s>", "<|im_end|>", stop])
    answer = client.post("/v1/completions", json=body).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and answer["text"] == free.text[:free.text.index(stop)]


def test_the_tokenizer_endpoints_are_the_engines_tokenizer(client: TestClient, engine: Engine) -> None:
    tokens = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens == {"tokens": engine.tokenizer(PROMPT)["input_ids"], "count": len(tokens["tokens"]),
                      "max_model_len": CONTEXT}
    bare = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "model": NAME}).json()
    assert bare["tokens"] == engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"] != tokens["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == engine.tokenizer.eos_token and info["model_max_length"] == CONTEXT
    assert info["chat_template"] == engine.tokenizer.chat_template
    # A token-id prompt made by /tokenize is the string prompt.
    assert client.post("/v1/completions", json=completion(tokens["tokens"])).json()["choices"] == \
        client.post("/v1/completions", json=completion()).json()["choices"]
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model")):
        error = client.post(path, json=body)
        assert error.status_code in (400, 404) and error.json()["error"]["param"] == param


def on_the_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_tokenizing_and_queueing_run_off_the_event_loop(client: TestClient, engine: Engine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's tokenization (or chat template) must not hold up the event loop that streams to the other
    clients: every engine call that grows with the prompt runs in a worker thread."""
    calls: list[tuple[str, bool]] = []

    def watched(name: str, method: Callable[..., object], *args: object, **kwargs: object) -> object:
        calls.append((name, on_the_event_loop()))
        return method(*args, **kwargs)

    for name in ("tokenize", "decode", "chat_prompt", "submit_prompts", "submit_many"):
        monkeypatch.setattr(engine, name, partial(watched, name, getattr(engine, name)))
    assert client.post("/tokenize", json={"prompt": PROMPT}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200
    assert client.post("/v1/completions", json=completion([5, 6, 7], echo=True)).status_code == 200
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200
    assert {name for name, _ in calls} == {"tokenize", "decode", "chat_prompt", "submit_prompts", "submit_many"}
    assert not any(loop for _, loop in calls), calls


def test_requests_queued_for_a_handler_cancelled_meanwhile_are_cancelled() -> None:
    """The handler awaits the worker thread that queues its requests; cancelled then (the server stopping), it
    must not leave them running unread, holding their slots and KV memory."""
    started, release = threading.Event(), threading.Event()
    streams = [SimpleNamespace(cancelled=False) for _ in range(3)]
    for stream in streams:
        stream.cancel = partial(setattr, stream, "cancelled", True)

    def submit() -> tuple[list, None]:
        started.set()
        release.wait(10)
        return [streams[:2], streams[2:]], None

    async def cancel_while_queueing() -> None:
        task = asyncio.ensure_future(_queued(submit))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not any(stream.cancelled for stream in streams)  # still queueing
        release.set()
        for _ in range(100):
            if all(stream.cancelled for stream in streams):
                return
            await asyncio.sleep(0.05)

    asyncio.run(cancel_while_queueing())
    assert all(stream.cancelled for stream in streams)


def test_echo_starts_each_choice_with_its_prompt(client: TestClient, engine: Engine) -> None:
    body = client.post("/v1/completions", json=completion(echo=True, max_tokens=6, ignore_eos=True)).json()
    alone = greedy(engine, PROMPT, 6)
    assert body["choices"][0]["text"] == PROMPT + alone.text
    ids = engine.tokenizer(PROMPT)["input_ids"]
    by_ids = client.post("/v1/completions", json=completion(ids, echo=True, max_tokens=0)).json()
    assert by_ids["choices"][0] == {"index": 0, "text": engine.decode(ids), "finish_reason": "length",
                                    "logprobs": None}
    assert by_ids["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    chunks, last = sse_chunks(client.post("/v1/completions", json=completion(
        echo=True, max_tokens=6, ignore_eos=True, stream=True)).text)
    assert last == "[DONE]" and chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + alone.text


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client: TestClient, engine: Engine,
                                                                  max_tokens: int) -> None:
    """What lm-evaluation-harness's local-completions sends for a log-likelihood: token ids, echo, logprobs and
    max_tokens 1 (or 0); the prompt's tokens come first, the first with nulls."""
    ids = [engine.tokenizer(text)["input_ids"] for text in (PROMPT, "hello there, the fox")]
    body = completion(ids, echo=True, logprobs=2, max_tokens=max_tokens, ignore_eos=True)
    whole = client.post("/v1/completions", json=body).json()
    pieces = engine.token_pieces
    for prompt, choice in zip(ids, whole["choices"], strict=True):
        logprobs = choice["logprobs"]
        scored = greedy(engine, prompt, max_tokens, logprobs=2, prompt_logprobs=2)
        assert len(scored.prompt_logprobs) == len(prompt) - 1
        assert logprobs["tokens"] == [pieces.text(t) for t in prompt + scored.token_ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = [e.logprob for e in scored.prompt_logprobs + scored.logprobs]
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-5)
        for entry, top in zip(scored.prompt_logprobs, logprobs["top_logprobs"][1:], strict=False):
            assert pieces.text(entry.token) in top and len(top) >= 2  # the prompt token and the 2 likeliest
            assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-5)
        echoed = engine.decode(prompt)
        assert choice["text"] == echoed + scored.text
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[len(prompt):] == [len(echoed) + e.offset for e in scored.logprobs]
    if max_tokens:
        chunks, _ = sse_chunks(client.post("/v1/completions", json=body | {"stream": True}).text)
        for index, choice in enumerate(whole["choices"]):
            streamed = streamed_logprobs(chunks, index)
            assert streamed["tokens"] == choice["logprobs"]["tokens"]
            assert streamed["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_choices_whose_events_wait_already_take_turns() -> None:
    """A reader that starts after the engine queued several events of each choice still interleaves them."""
    import asyncio

    from llmeasyquant.runtime.engine import RequestStream
    from llmeasyquant.serving.app import _merged

    async def order() -> list[int]:
        streams = [RequestStream(f"cmpl-{i}", [5, 6, 7]) for i in range(3)]
        for stream in streams:
            for k in range(4):
                stream.push(TokenEvent("x", (k,), 3, k + 1, "length" if k == 3 else None))
        return [index async for index, _ in _merged(streams)]

    assert asyncio.run(asyncio.wait_for(order(), timeout=10)) == [0, 1, 2] * 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_choice_that_fails_cancels_the_others(client: TestClient, engine: Engine,
                                                 monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    made: list = []
    submit_prompts = engine.submit_prompts

    def one_fails(prompts, params, n=1):
        groups = submit_prompts(prompts, params, n)
        streams = groups[0]
        made.extend(streams)
        # What the engine pushes when a step fails, to one choice only: the others must not run on.
        streams[1].push(TokenEvent("", (), streams[1].prompt_tokens, 0, "error"))
        streams[1].cancel()
        return groups

    monkeypatch.setattr(engine, "submit_prompts", one_fails)
    body = completion(max_tokens=200, ignore_eos=True, n=3, stream=stream)
    response = client.post("/v1/completions", json=body)
    if stream:
        payloads, last = sse_chunks(response.text)
        assert last == "[DONE]" and payloads[-1]["error"]["code"] == "decode_failed"
    else:
        assert response.status_code == 500 and response.json()["error"]["code"] == "decode_failed"
    assert len(made) == 3 and all(s.cancelled for s in made)
    monkeypatch.undo()
    wait_for(lambda: engine.stats().running == 0)  # the engine ends cancelled sequences at its next step
    assert engine.stats().blocks_used == 0
    assert all(s.finished for s in made)
    assert client.post("/v1/completions", json=completion(max_tokens=2)).status_code == 200


def test_n_choices_are_all_queued_or_refused_with_429(folder: Path) -> None:
    engine = Engine.load(str(folder), EngineConfig(kv_memory_mb=4, max_running=1, max_queue=1,
                                                   max_context=CONTEXT), NAME)
    forward = engine.decoder.forward

    def slowed(*args, **kwargs):  # the tiny model's 200 steps can end between two polls of wait_for
        time.sleep(0.005)
        return forward(*args, **kwargs)

    engine.decoder.forward = slowed
    with TestClient(build_app(engine, NAME)) as client:
        running = engine.submit([5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        wait_for(lambda: engine.stats().running == 1)  # it holds the one running slot
        refused = client.post("/v1/completions", json=completion(n=2))  # one could wait, the other not
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert engine.stats().waiting == 0  # neither choice was queued
        running.cancel()
        wait_for(lambda: engine.stats().running == 0)
        whole = client.post("/v1/completions", json=completion(n=2))  # one runs, the other waits its turn
        assert whole.status_code == 200 and len(whole.json()["choices"]) == 2


def wait_for(condition, timeout_s: float = 30.0) -> None:
    """Poll condition() every 50 ms, at most timeout_s; fail if it never holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.05)


# bad input -------------------------------------------------------------------------------------------------------

TOO_LONG = " ".join(["the quick brown fox"] * 200)
BAD = [  # (endpoint, body, status, param, code or None to skip, words the message holds)
    ("completions", completion(max_tokens=0), 400, "max_tokens", None, "only with echo"),
    ("completions", completion(max_tokens=-3), 400, "max_tokens", None, "max_tokens"),
    ("completions", completion(max_tokens=CONTEXT), 400, "max_tokens", "context_length_exceeded", "context"),
    ("completions", completion(TOO_LONG), 400, "prompt", "context_length_exceeded", "prompt"),
    ("completions", completion(temperature=2.5), 400, "temperature", None, "[0, 2]"),
    ("completions", completion(temperature=-0.1), 400, "temperature", None, "[0, 2]"),
    ("completions", completion(top_p=0), 400, "top_p", None, "(0, 1]"),
    ("completions", completion(top_p=1.5), 400, "top_p", None, "(0, 1]"),
    ("completions", completion(n=17), 400, "n", "invalid_value", "[1, 16]"),
    ("completions", completion(n=0), 400, "n", "invalid_value", "[1, 16]"),
    ("completions", completion(n=9), 400, "n", None, "at most 8"),  # past max_running + max_queue
    ("completions", completion(n=2.0), 400, "n", "int_type", "integer"),
    ("completions", completion(max_tokens="8"), 400, "max_tokens", "int_type", "integer"),
    ("completions", completion(temperature="hot"), 400, "temperature", "float_type", "number"),
    ("completions", completion(stream="yes"), 400, "stream", "bool_type", "boolean"),
    ("completions", {"model": NAME}, 400, "prompt", "missing", "prompt"),
    ("completions", completion(model="gpt-4"), 404, "model", "model_not_found", "gpt-4"),
    ("completions", completion(["one", TOO_LONG]), 400, "prompt", "context_length_exceeded", "prompt 1: the prompt"),
    ("completions", completion(["one", 5]), 400, "prompt", None, "list of prompts"),
    ("completions", completion([[5, 6], [7, 999_999]]), 400, "prompt", None, "prompt 1: token id 999999"),
    ("completions", completion(["a"] * 5, n=2), 400, "prompt", None, "5 prompts x n=2"),
    ("completions", completion([]), 400, "prompt", None, "empty"),
    ("completions", completion(12), 400, "prompt", None, "string"),
    ("completions", completion([5, 999_999]), 400, "prompt", None, "vocabulary"),
    ("completions", completion(logprobs=21), 400, "logprobs", "invalid_value", "[0, 20]"),
    ("completions", completion(logprobs=-1), 400, "logprobs", "invalid_value", "[0, 20]"),
    ("completions", completion(logprobs=True), 400, "logprobs", "int_type", "integer"),
    ("completions", completion(best_of=3), 400, "best_of", "unsupported", "best_of"),
    ("completions", completion(best_of=1, n=2), 400, "best_of", "invalid_value", "at least n"),
    ("completions", completion(suffix="!"), 400, "suffix", "unsupported", "suffix"),
    ("completions", completion(presence_penalty=2.5), 400, "presence_penalty", None, "[-2, 2]"),
    ("completions", completion(frequency_penalty=-2.1), 400, "frequency_penalty", None, "[-2, 2]"),
    ("completions", completion(frequency_penalty="1"), 400, "frequency_penalty", "float_type", "number"),
    ("completions", completion(logit_bias={"abc": 1}), 400, "logit_bias", "invalid_value", "'abc'"),
    ("completions", completion(logit_bias={"12.5": 1}), 400, "logit_bias", "invalid_value", "0..255"),
    ("completions", completion(logit_bias={"256": 1}), 400, "logit_bias", "invalid_value", "'256'"),
    ("completions", completion(logit_bias={"-1": 1}), 400, "logit_bias", "invalid_value", "0..255"),
    ("completions", completion(logit_bias={"5": 100.5}), 400, "logit_bias", None, "[-100, 100]"),
    ("completions", completion(logit_bias={"5": "1"}), 400, "logit_bias.5", "float_type", "number"),
    ("completions", completion(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias", "invalid_value",
     "at most 300"),
    ("completions", completion(logit_bias={f"{'0' * (i // 250)}{i % 250}": 1 for i in range(301)}), 400,
     "logit_bias", "invalid_value", "at most 300"),  # 301 keys as sent, 250 token ids
    ("completions", completion(stop=[f"s{i}" for i in range(17)]), 400, "stop", None, "up to 16"),
    ("completions", completion(stream_options={"include_usage": True}), 400, "stream_options", None, "stream"),
    ("completions", completion(repetition_penalty=1.2), 400, "repetition_penalty", "extra_forbidden",
     "unrecognized"),
    ("chat/completions", chat(messages=[]), 400, "messages", None, "at least one"),
    ("chat/completions", chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role",
     "literal_error", "'user'"),
    ("chat/completions", chat(messages=[{"role": "user"}]), 400, "messages.0.content", "missing", "content"),
    ("chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content", "unsupported", "image_url"),
    ("chat/completions", chat(messages="hello"), 400, "messages", "list_type", "list"),
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "unsupported", "tools"),
    ("chat/completions", chat(top_logprobs=2), 400, "top_logprobs", "invalid_value", "logprobs set to true"),
    ("chat/completions", chat(logprobs=False, top_logprobs=0), 400, "top_logprobs", "invalid_value", "logprobs"),
    ("chat/completions", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value", "[0, 20]"),
    ("chat/completions", chat(logprobs=3), 400, "logprobs", "bool_type", "boolean"),
    ("chat/completions", chat(presence_penalty=-3), 400, "presence_penalty", None, "[-2, 2]"),
    ("chat/completions", chat(response_format={"type": "json_object"}), 400, "response_format", "unsupported",
     "json_object"),
    ("chat/completions", chat(n=17), 400, "n", "invalid_value", "[1, 16]"),
    ("chat/completions", chat(max_tokens=0), 400, "max_tokens", None, "generates nothing"),
    ("chat/completions", chat(TOO_LONG), 400, "prompt", "context_length_exceeded", "prompt"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "code", "words"), BAD,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, _, p, *_) in enumerate(BAD)])
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(client: TestClient, endpoint: str, body: dict,
                                                                 status: int, param: str, code: str | None,
                                                                 words: str) -> None:
    response = client.post(f"/v1/{endpoint}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert words in error["message"]
    assert client.post("/v1/completions", json=completion(max_tokens=2)).status_code == 200


@pytest.mark.parametrize(("raw", "words"), [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                            (b"", "not valid JSON"), (b"\xff\xfe{", "JSON")])
def test_a_body_that_is_no_json_object(client: TestClient, raw: bytes, words: str) -> None:
    response = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]


def test_a_body_past_the_limit_is_413(client: TestClient) -> None:
    from llmeasyquant.serving.app import MAX_BODY_BYTES

    response = client.post("/v1/completions", json=completion("x" * MAX_BODY_BYTES))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_developer_is_system_and_text_parts_join(client: TestClient) -> None:
    as_system = client.post("/v1/chat/completions", json=chat(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])).json()
    as_developer = client.post("/v1/chat/completions", json=chat(messages=[
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}],
        user="someone")).json()
    assert as_developer["choices"] == as_system["choices"] and as_developer["usage"] == as_system["usage"]


def test_unknown_paths_and_methods_answer_openai_errors(client: TestClient) -> None:
    missing = client.get("/v1/engines")
    assert missing.status_code == 404 and "/v1/completions" in missing.json()["error"]["message"]
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_queue_full_is_429_with_retry_after(client: TestClient, engine: Engine,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> None:
        raise QueueFull("4 requests are running and 4 waiting; retry later", retry_after_s=2.5)

    monkeypatch.setattr(engine, "submit_prompts", full)
    response = client.post("/v1/completions", json=completion())
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "3"
    assert response.json()["error"]["code"] == "queue_full"


def test_a_stopped_engine_is_503(client: TestClient, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def stopped(*_: object) -> None:
        raise EngineStopped("the server is shutting down and takes no new request")

    monkeypatch.setattr(engine, "submit_many", stopped)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]


def test_an_unexpected_failure_is_a_500_and_the_server_goes_on(client: TestClient, engine: Engine,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "chat_prompt", broken)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error" and "RuntimeError" in response.json()["error"]["message"]
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_a_tokenizer_without_chat_template_refuses_chat(client: TestClient, engine: Engine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    response = client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]


# metrics ---------------------------------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_and_the_kv_cache(client: TestClient, engine: Engine) -> None:
    before = metric_samples(client.get("/metrics").text)
    ok = client.post("/v1/completions", json=completion(max_tokens=5, ignore_eos=True)).json()
    client.post("/v1/completions", json=completion(max_tokens=5, ignore_eos=True, stream=True))
    client.post("/v1/completions", json=completion(temperature=9))
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = metric_samples(response.text)
    assert requests_by(after, "ok") - requests_by(before, "ok") == 2
    assert requests_by(after, "error_4xx") - requests_by(before, "error_4xx") == 1
    assert requests_by(after, "cancelled") == requests_by(before, "cancelled")
    tokens = ok["usage"]
    assert after["llmeasyquant_prompt_tokens_total", ()] - before["llmeasyquant_prompt_tokens_total", ()] == \
        2 * tokens["prompt_tokens"]
    assert after["llmeasyquant_generation_tokens_total", ()] - \
        before["llmeasyquant_generation_tokens_total", ()] == 2 * tokens["completion_tokens"] == 10
    ttft = "llmeasyquant_time_to_first_token_seconds_count", ()
    itl = "llmeasyquant_inter_token_latency_seconds_count", ()
    assert after[ttft] - before[ttft] == 2
    assert after[itl] - before[itl] == 2 * 4
    stats = engine.stats()
    assert after["llmeasyquant_kv_cache_used_bytes", ()] == 0 == stats.kv_bytes_used
    assert after["llmeasyquant_kv_cache_free_bytes", ()] == stats.kv_bytes_total > 0
    assert after["llmeasyquant_kv_capacity_sequences", ()] == engine.kv_capacity(1024)
    assert after["llmeasyquant_queue_depth", ()] == 0 and after["llmeasyquant_running_sequences", ()] == 0
    assert after["llmeasyquant_kv_cache_blocks_total", ()] == stats.blocks_total
    for outcome in ("ok", "error_4xx", "error_5xx", "cancelled", "shutdown"):
        assert ("llmeasyquant_requests_total", (("outcome", outcome),)) in after


# auth and the lifespan ---------------------------------------------------------------------------------------------


def test_api_key_guards_every_endpoint_but_health(folder: Path) -> None:
    engine = make_engine(folder)
    with TestClient(build_app(engine, NAME, api_key=KEY)) as client:
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/tokenizer_info")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = client.request(method, path, headers=headers, json=completion())
                assert response.status_code == 401, (path, headers)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
                assert KEY not in response.text
        assert client.get("/health").status_code == 200
        good = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.post("/v1/completions", headers=good, json=completion()).status_code == 200
        samples = metric_samples(client.get("/metrics", headers=good).text)
        assert requests_by(samples, "error_4xx") == 18  # /metrics is not counted
    assert not engine.stats().accepting  # the lifespan shut it down


def test_the_lifespan_shutdown_stops_the_engine(folder: Path) -> None:
    engine = make_engine(folder)
    with TestClient(build_app(engine, NAME, shutdown_grace_s=1.0)) as client:
        assert client.get("/health").json()["status"] == "ok"
    assert not engine.stats().accepting
    with TestClient(build_app(engine, NAME)) as client:
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json=completion())
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"


def test_import_llmeasyquant_needs_no_server_package() -> None:
    """`import llmeasyquant` and the CLI's parser load none of the serve extra's packages."""
    code = ("import json, sys, llmeasyquant; from llmeasyquant.cli.main import build_parser; build_parser(); "
            "print(json.dumps([n for n in ('fastapi', 'uvicorn', 'sse_starlette', 'prometheus_client') "
            "if n in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
