"""The serving engine: greedy tokens against the lean decoder, batch invariance, the KV pool's budget, the queue,
cancellation, stop strings, sampling and shutdown."""

from __future__ import annotations

import dataclasses
import gc
import threading
from functools import partial

import pytest
import torch
from tests.runtime.test_decoder import FAMILIES, family_model

import llmeasyquant as lq
from llmeasyquant import LeanDecoder
from llmeasyquant.errors import ConfigError
from llmeasyquant.methods import Rotate
from llmeasyquant.methods.rtn import RTN
from llmeasyquant.nn.kv.config import KVQuantConfig
from llmeasyquant.plan import Plan, Rule
from llmeasyquant.runtime.detokenize import Detokenizer
from llmeasyquant.runtime.engine import Engine, EngineConfig
from llmeasyquant.runtime.kv_pool import FloatPool, QuantPool, Shape
from llmeasyquant.runtime.requests import EngineStopped, QueueFull, RequestError, SamplingParams
from llmeasyquant.scheme import parse_scheme

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def lively() -> torch.nn.Module:
    """A tiny llama whose greedy continuations vary (random norm weights), so that a mixed-up row would show."""
    return family_model("llama")


def prompts(count: int, vocab: int = 256) -> list[list[int]]:
    """Prompts of different lengths, some past a prefill chunk and a KV block."""
    lengths = [5, 37, 20, 9, 64, 3, 41, 16][:count]
    return [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def run_all(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Submit every prompt before reading any stream: they run together."""
    streams = [engine.submit(p, params) for p in batch]
    return [[t for event in stream for t in event.token_ids] for stream in streams]


@pytest.fixture
def engine_for(tiny_tokenizer):
    made: list[Engine] = []

    def make(model: torch.nn.Module, **options) -> Engine:
        engine = Engine(model, tiny_tokenizer, EngineConfig(**{"kv_memory_mb": 8, "prefill_chunk": 16} | options))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown(grace_s=5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_equals_the_lean_decoder(engine_for, family):
    model = family_model(family)
    engine = engine_for(model, kv_dtype="float32")
    batch = prompts(4)
    for prompt, tokens in zip(batch, run_all(engine, batch), strict=True):
        alone = LeanDecoder(model, len(prompt) + 12).generate(torch.tensor(prompt), 12).tolist()
        assert tokens == alone


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16-g32", "w8a16", "w8a8+head", "w8a4-as1", "w4a4-aasym-ag32-g32"])
def test_eight_in_a_batch_equal_each_alone_on_the_reference_kernel(engine_for, monkeypatch, scheme):
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "reference")
    body, _, head = scheme.partition("+")
    plan = Plan.uniform(parse_scheme(body))
    if head:  # the LM head at W8A16 too, as `quantize --lm-head w8a16` does
        plan = Plan((Rule("lm_head", parse_scheme("w8a16")), *plan.rules))
    model = lq.quantize(lively(), RTN(), plan, progress=False)
    batch = prompts(8)
    together = run_all(engine_for(model), batch)
    alone = [run_all(engine_for(model), [p])[0] for p in batch]
    assert together == alone


def test_sink_tokens_in_eight_bits_serve_as_the_lean_decoder_runs_them(engine_for, monkeypatch):
    """The engine tells each layer its rows' positions (a prompt's first token keeps 8-bit activations) as the lean
    decoder does: the same greedy tokens, and not those of the model without sinks."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "reference")
    model = lq.quantize(lively(), RTN(), parse_scheme("w8a4-as1"), progress=False)
    batch = prompts(4)
    served = run_all(engine_for(model, kv_dtype="float32"), batch)
    for prompt, tokens in zip(batch, served, strict=True):
        assert tokens == LeanDecoder(model, len(prompt) + 12).generate(torch.tensor(prompt), 12).tolist()


def test_default_kernels_agreement_is_reported(engine_for, record_property):
    model = lq.quantize(lively(), RTN(), parse_scheme("w4a16-g32"), progress=False)
    batch = prompts(8)
    together = run_all(engine_for(model), batch)
    alone = [run_all(engine_for(model), [p])[0] for p in batch]
    same = sum(a == b for x, y in zip(together, alone, strict=True) for a, b in zip(x, y, strict=True))
    record_property("greedy_tokens_equal", f"{same}/{8 * GREEDY.max_tokens}")
    assert same >= 0.75 * 8 * GREEDY.max_tokens


def test_four_bit_cache_follows_the_float_cache(engine_for):
    model = lively()
    batch = prompts(4)
    exact = run_all(engine_for(model, kv_dtype="float32"), batch)
    coded = run_all(engine_for(model, kv_bits=4), batch)
    same = sum(a == b for x, y in zip(exact, coded, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.5 * 4 * GREEDY.max_tokens


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_every_cache_width_serves(engine_for, bits):
    tokens = run_all(engine_for(lively(), kv_bits=bits), prompts(3))
    assert [len(t) for t in tokens] == [12, 12, 12]


def test_four_bit_pool_holds_three_times_the_fp16_sequences():
    shape = Shape(layers=30, kv_heads=3, head_dim=64, heads=9)  # SmolLM2-135M
    budget = 512 * 2**20
    fp16 = FloatPool(shape, budget, 64, 2048, "float16")
    table = torch.zeros(2048, 64)
    coded = QuantPool(shape, budget, 64, 2048, KVQuantConfig(key_bits=4, value_bits=4), table, table)
    assert coded.capacity(1024) >= 3 * fp16.capacity(1024) > 0


def test_the_pool_keeps_its_own_layout_for_compact_or_kept_channel_options():
    shape = Shape(layers=2, kv_heads=3, head_dim=64, heads=9)
    table = torch.zeros(256, 64)
    plain = QuantPool(shape, 2**20, 4, 256, KVQuantConfig(3, 3, key_block=16), table, table)
    offline = KVQuantConfig(3, 3, key_block=16, key_channels=8, compact=True)
    pool = QuantPool(shape, 2**20, 4, 256, offline, table, table)
    assert pool.kind == plain.kind and pool.block_bytes == plain.block_bytes


def test_pool_gives_blocks_back():
    pool = FloatPool(Shape(2, 2, 16, 4), 2**20, 4, 256, "float32")
    free = pool.num_blocks
    slots = [pool.allocate(100) for _ in range(3)]
    assert pool.blocks_used == 3 * pool.blocks_for(100)
    for slot in slots:
        pool.release(slot)
    assert pool.blocks_used == 0 and len(pool._free_blocks) == free
    assert pool.allocate(10**6) is None


def test_requests_that_cannot_run_are_refused_with_the_field(engine_for):
    engine = engine_for(lively(), max_context=64)
    with pytest.raises(RequestError, match="context") as error:
        engine.submit(list(range(3, 70)), GREEDY)
    assert error.value.param == "prompt"
    with pytest.raises(RequestError, match="at most 54") as error:
        engine.submit(list(range(3, 13)), SamplingParams(max_tokens=60))
    assert error.value.param == "max_tokens"
    for bad, field in [(SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(temperature=3.0), "temperature"),
                       (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(top_k=-1), "top_k")]:
        with pytest.raises(RequestError) as error:
            engine.submit([5, 6], bad)
        assert error.value.param == field
    with pytest.raises(RequestError, match="vocabulary"):
        engine.submit([5, 10**6], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], GREEDY)
    assert engine.generate([5, 6, 7], GREEDY).completion_tokens == 12  # and it still serves


def test_a_request_larger_than_the_kv_budget_is_refused(engine_for):
    engine = engine_for(lively(), kv_memory_mb=0.05, max_context=256)
    with pytest.raises(RequestError, match="KV cache"):
        engine.submit([5] * 10, SamplingParams(max_tokens=240))


def test_a_full_queue_says_so_and_the_rest_still_run(engine_for):
    engine = engine_for(lively(), max_running=1, max_queue=1)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with engine._lock:  # hold the loop so that nothing is admitted while the queue fills
        first = engine.submit([5, 6, 7], long)
        with pytest.raises(QueueFull, match="retry"):
            engine.submit([5, 6, 7], long)
    assert [e for e in first][-1].finish_reason == "length"


def test_cancelled_requests_free_their_blocks(engine_for):
    engine = engine_for(lively())
    stream = engine.submit([5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    events = iter(stream)
    next(events)
    stream.cancel()
    assert [e.finish_reason for e in events][-1] == "cancelled"
    assert engine.stats().blocks_used == 0 and engine.stats().running == 0


def test_stop_strings_cut_the_text(engine_for, tiny_tokenizer):
    engine = engine_for(lively())
    free = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop = free.text[5:8]
    assert stop.strip(), free.text
    cut = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                           stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_the_text_is_what_prompt_and_completion_decode_to_past_the_prompt(engine_for, tiny_tokenizer):
    """The tiny tokenizer is SentencePiece-style: a completion that starts a word keeps its leading space."""
    engine = engine_for(lively())
    decode = partial(tiny_tokenizer.decode, skip_special_tokens=True)
    for prompt in prompts(4):
        done = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert done.text == decode(prompt + done.token_ids)[len(decode(prompt)):]


def test_seeded_sampling_repeats_whatever_runs_beside_it(engine_for):
    engine = engine_for(lively(), kv_dtype="float32")
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = run_all(engine, [[5, 6, 7]], params)[0]
    crowd = run_all(engine, [[5, 6, 7], *prompts(3)], params)[0]
    assert alone == crowd
    other = run_all(engine, [[5, 6, 7]], SamplingParams(**{**params.__dict__, "seed": 8}))[0]
    assert other != alone


def test_a_seeded_request_repeats_beside_requests_sampled_otherwise(engine_for):
    """The step chooses every sequence's token in one batched pass: a request's tokens must still be its own, beside
    greedy, biased, penalised, filtered and log-probability rows (and before, after and between them)."""
    engine = engine_for(lively(), kv_dtype="float32")
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=10, temperature=1.2, top_p=0.8, seed=13, ignore_eos=True)
    alone = run_all(engine, [prompt], params)[0]
    others = [dataclasses.replace(params, temperature=0.0), dataclasses.replace(params, seed=1, top_k=3),
              dataclasses.replace(params, seed=2, logit_bias={40: 5.0}, frequency_penalty=1.0, logprobs=2),
              dataclasses.replace(params, seed=3, top_p=0.05, temperature=2.0)]
    batch = prompts(4)
    for place in (0, 2, 4):
        requests = list(zip(batch, others, strict=True))
        requests.insert(place, (prompt, params))
        streams = [engine.submit(p, o) for p, o in requests]
        tokens = [[t for event in stream for t in event.token_ids] for stream in streams]
        assert tokens[place] == alone, place


def test_detokenizing_and_stop_strings_run_outside_the_engine_lock(engine_for, monkeypatch):
    """Per-sequence text work must not hold the lock that submitting requests and reading stats take."""
    engine = engine_for(lively())
    held: list[bool] = []
    add = Detokenizer.add

    def watched(self: Detokenizer, token: int) -> str:
        held.append(engine._lock._is_owned())
        return add(self, token)

    monkeypatch.setattr(Detokenizer, "add", watched)
    run_all(engine, prompts(3), dataclasses.replace(GREEDY, stop=("never there",)))
    assert len(held) == 3 * GREEDY.max_tokens and not any(held)


def test_eos_ends_a_request_as_stop(engine_for, tiny_tokenizer):
    model = lively()
    engine = engine_for(model, kv_dtype="float32")
    prompt = prompts(5)[4]
    free = engine.generate(prompt, GREEDY).token_ids
    first_new = next(i for i, token in enumerate(free) if i and token not in free[:i])
    engine.eos = {free[first_new]}
    ended = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert ended.completion_tokens == first_new
    assert ended.finish_reason == "stop"
    assert ended.token_ids == free[:first_new]  # the end-of-sequence token is never shown


def test_shutdown_ends_running_and_waiting_requests(engine_for):
    engine = engine_for(lively(), max_running=1)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    running, waiting = engine.submit([5, 6], long), engine.submit([7, 8], long)
    next(iter(running))
    closer = threading.Thread(target=engine.shutdown, kwargs={"grace_s": 0.0})
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive()
    assert [e.finish_reason for e in running][-1] == "shutdown"
    assert [e.finish_reason for e in waiting][-1] == "shutdown"
    with pytest.raises(EngineStopped):
        engine.submit([5], GREEDY)


def test_a_running_engine_keeps_the_collector_off_what_existed_before_it(engine_for):
    gc.unfreeze()
    engine = engine_for(lively())
    run_all(engine, prompts(1))  # starts the loop
    assert gc.get_freeze_count() > 0, "the model and pool should be frozen out of the collector while serving"
    engine.shutdown(grace_s=5)
    assert gc.get_freeze_count() == 0, "shutdown should hand what was frozen back to the collector"


def test_chat_prompt_needs_a_template_and_wellformed_messages(engine_for):
    engine = engine_for(lively())
    with pytest.raises(RequestError, match="chat template"):
        engine.chat_prompt([{"role": "user", "content": "hi"}])
    engine.tokenizer = _with_template(engine.tokenizer)
    with pytest.raises(RequestError, match="messages\\[0\\]"):
        engine.chat_prompt([{"role": "robot", "content": "hi"}])
    ids = engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert ids and all(isinstance(i, int) for i in ids)


def _with_template(tokenizer):
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    return templated


def test_engine_options_are_checked():
    with pytest.raises(ConfigError, match="max_running"):
        EngineConfig(max_running=0)
    with pytest.raises(ConfigError, match="KV memory"):
        EngineConfig(kv_memory_mb=0)


def test_online_rotated_model_serves_the_tokens_of_the_eval_path(engine_for, monkeypatch):
    """Rotate's online Hadamard lives in the down projection's QuantLinear, which the engine's batched blocks call:
    greedy tokens equal transformers' own generate on the same quantized model."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL", "reference")
    model = lq.quantize(lively(), [Rotate(online_down=True), RTN()], parse_scheme("w8a16"), progress=False)
    assert all(layer.mlp.down_proj.input_transform is not None for layer in model.model.layers)
    engine = engine_for(model, kv_dtype="float32")
    batch = prompts(3)
    for prompt, tokens in zip(batch, run_all(engine, batch), strict=True):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected


# logit_bias, penalties, log probabilities, n ---------------------------------------------------------------------


@torch.no_grad()
def reference_decode(model: torch.nn.Module, prompt: list[int], params: SamplingParams,
                     tokens: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Decoding by the model's own forward over the whole sequence at every step, with logit_bias and the penalties
    written out as OpenAI defines them (in float64): the tokens (greedy, or `tokens` when given) and each step's
    log-softmax of those logits."""
    bias = dict(params.logit_bias)
    chosen: list[int] = []
    logprobs = []
    for step in range(params.max_tokens if tokens is None else len(tokens)):
        logits = model(torch.tensor([prompt + chosen])).logits[0, -1].double()
        for token, value in bias.items():
            logits[token] += value
        for token in set(chosen):
            logits[token] -= params.presence_penalty + params.frequency_penalty * chosen.count(token)
        logprobs.append(logits.log_softmax(-1))
        chosen.append(int(logits.argmax()) if tokens is None else tokens[step])
    return chosen, logprobs


def test_bias_and_penalties_decode_as_the_reference(engine_for):
    model = lively()
    engine = engine_for(model, kv_dtype="float32")
    prompt = prompts(2)[1]
    plain = engine.generate(prompt, GREEDY).token_ids
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.6, logit_bias={plain[0]: -100.0, 77: 2.0, 78: -1.5})
    shaped = engine.generate(prompt, params).token_ids
    assert shaped == reference_decode(model, prompt, params)[0]
    assert shaped != plain and plain[0] not in shaped
    forced = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={77: 100})
    assert engine.generate(prompt, forced).token_ids == [77] * 5


def test_logprobs_are_the_models_log_softmax_before_temperature(engine_for):
    model = lively()
    engine = engine_for(model, kv_dtype="float32")
    prompt = prompts(3)[2]
    for params in (SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5),
                   SamplingParams(max_tokens=10, temperature=1.5, top_k=5, seed=3, ignore_eos=True, logprobs=5,
                                  logit_bias={9: 3.0}, frequency_penalty=1.0)):
        result = engine.generate(prompt, params)
        tokens = result.token_ids
        _, reference = reference_decode(model, prompt, params, tokens)
        assert [entry.token for entry in result.logprobs] == tokens
        for entry, logprobs in zip(result.logprobs, reference, strict=True):
            assert entry.logprob == pytest.approx(logprobs[entry.token].item(), abs=1e-4)
            values, ids = logprobs.topk(5)
            assert [token for token, _ in entry.top] == ids.tolist()
            assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        offsets = [entry.offset for entry in result.logprobs]
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(result.text)


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}])
def test_plain_requests_decode_the_same_beside_shaped_ones_and_logprobs_change_no_token(engine_for, options):
    engine = engine_for(lively(), kv_dtype="float32")
    batch = prompts(4)
    plain = SamplingParams(max_tokens=10, ignore_eos=True, **options)
    alone = run_all(engine, batch, plain)
    streams = [engine.submit(p, plain) for p in batch[:2]]
    # (Sampled from the tiny model's flat distribution, tokens seldom repeat: a bias makes the penalty show.)
    penalised = {"frequency_penalty": 1.5} if plain.greedy else {"presence_penalty": -2.0, "logit_bias": {60: 4.0}}
    streams += [engine.submit(batch[2], SamplingParams(**{**plain.__dict__, **penalised})),
                engine.submit(batch[3], SamplingParams(**{**plain.__dict__, "logit_bias": {50: 9.0}}))]
    mixed = [[t for event in stream for t in event.token_ids] for stream in streams]
    assert mixed[:2] == alone[:2]
    assert mixed[2] != alone[2] and mixed[3] != alone[3]
    asking = run_all(engine, batch, SamplingParams(**{**plain.__dict__, "logprobs": 3}))
    assert asking == alone


@pytest.mark.parametrize("inside", [False, True], ids=["at-a-token", "inside-a-token"])
def test_logprobs_with_a_stop_string_cover_exactly_the_text_shown(engine_for, inside):
    engine = engine_for(lively(), kv_dtype="float32")
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    free = engine.generate(prompt, params)
    assert len(free.logprobs) == 30
    # A stop string that starts where token k's text does (k and the tokens after it are cut off), or one
    # character into it (token k shows in part: it stays).
    k = next(i for i in range(4, 29) if free.logprobs[i + 1].offset - free.logprobs[i].offset >= 2)
    cut_at = free.logprobs[k].offset + inside
    stop = free.text[cut_at:cut_at + 3]
    assert free.text.index(stop) == cut_at, "the stop string should not appear earlier"
    stream = engine.submit(prompt, SamplingParams(**{**params.__dict__, "stop": (stop,)}))
    events = list(stream)
    text = "".join(event.text for event in events)
    sent = [entry for event in events for entry in event.logprobs]
    assert text == free.text[:cut_at] and events[-1].finish_reason == "stop"
    # The tokens whose text starts before the stop string, each once, in order; none of those it cut off.
    assert sent == free.logprobs[:k + inside]
    assert events[-1].completion_tokens > k + inside
    shown = 0
    for event in events:  # never ahead of the text: a token's text is out when its log probability is
        shown += len(event.text)
        assert all(entry.offset < shown for entry in event.logprobs)


def test_logprobs_held_back_with_a_stop_prefix_come_once_in_order(engine_for):
    engine = engine_for(lively(), kv_dtype="float32")
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    free = engine.generate(prompt, params)
    k = next(i for i in range(3, 19) if free.logprobs[i + 1].offset > free.logprobs[i].offset)
    held = free.text[free.logprobs[k].offset:free.logprobs[k + 1].offset]
    # Token k's text followed by a character that never comes: its text is held back, then let go with the next.
    events = list(engine.submit(prompt, SamplingParams(**{**params.__dict__, "stop": (held + "\x07",)})))
    assert "".join(event.text for event in events) == free.text
    assert [entry for event in events for entry in event.logprobs] == free.logprobs
    sizes = [len(event.logprobs) for event in events]
    assert sizes[k] == 0 and events[k].text == "" and sizes[k + 1] == 2


def test_n_completions_are_n_sequences_seeded_seed_plus_index(engine_for):
    engine = engine_for(lively(), kv_dtype="float32")
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=21, ignore_eos=True)
    streams = engine.submit_many(prompt, params, 3)
    assert len({stream.id for stream in streams}) == 3
    choices = [[t for event in stream for t in event.token_ids] for stream in streams]
    singles = [run_all(engine, [prompt], SamplingParams(**{**params.__dict__, "seed": 21 + i}))[0] for i in range(3)]
    assert choices == singles
    assert len({tuple(c) for c in choices}) == 3
    assert engine.submit_many(prompt, params, 3) and choices == \
        [[t for event in stream for t in event.token_ids] for stream in engine.submit_many(prompt, params, 3)]
    greedy = engine.submit_many(prompt, GREEDY, 2)
    assert len({tuple(t for event in stream for t in event.token_ids) for stream in greedy}) == 1


def test_n_completions_are_all_queued_or_none(engine_for):
    engine = engine_for(lively(), max_running=1, max_queue=2)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for bad in (0, 4, 17, True):  # 4: more than max_running + max_queue could ever hold
        with pytest.raises(RequestError) as error:
            engine.submit_many([5, 6, 7], long, bad)
        assert error.value.param == "n"
    with engine._lock:  # hold the loop so that nothing is admitted while the queue fills
        streams = engine.submit_many([5, 6, 7], long, 3)  # one would start at once, two wait
        for n in (1, 2):
            with pytest.raises(QueueFull, match="retry"):
                engine.submit_many([5, 6, 7], long, n)
        assert engine.stats().waiting == 3  # nothing of the refused requests was queued
    assert [[e for e in stream][-1].finish_reason for stream in streams] == ["length"] * 3


def test_logit_bias_outside_the_vocabulary_is_refused_with_the_range(engine_for):
    engine = engine_for(lively())
    with pytest.raises(RequestError, match=r"300.*0\.\.255") as error:
        engine.submit([5, 6], SamplingParams(logit_bias={300: 1.0}))
    assert error.value.param == "logit_bias"
    assert engine.generate([5, 6, 7], GREEDY).completion_tokens == 12  # and it still serves


def reference_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the model's own full forward over the prompt: [positions, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("budget", [16, 200])
def test_a_step_prefills_at_most_the_budget_and_prompts_sent_together_share_one(engine_for, budget):
    """`prefill_chunk` prompt tokens a step over all sequences: prompts queued together that fit it are prefilled in
    one step and then decode in step (llama-server's schedule); over it, they take as many steps as it says."""
    model = lively()
    engine = engine_for(model, max_running=4, prefill_chunk=budget)
    steps: list[int] = []
    forward = engine.decoder.forward

    def counted(ids, rows, wanted):
        steps.append(int(ids.shape[0]))
        return forward(ids, rows, wanted)

    engine.decoder.forward = counted
    batch = prompts(4)  # 5 + 37 + 20 + 9 = 71 prompt tokens
    streams = engine.submit_prompts(batch, GREEDY)
    tokens = [[t for event in stream for t in event.token_ids] for [stream] in streams]
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    if budget >= 71:
        assert steps[:2] == [71, 4]  # every prompt in the first step, then four decode rows
    else:
        assert max(steps) <= budget + 4 and sum(1 for rows in steps if rows > 4) >= 71 // budget
    assert sum(steps) == 71 + 4 * (GREEDY.max_tokens - 1)


def test_prompt_logprobs_are_the_models_own_over_every_chunk(engine_for):
    model = lively()
    engine = engine_for(model, kv_dtype="float32")  # the fixture's chunks are 16 tokens: 41 tokens take three
    prompt = prompts(7)[6]
    done = engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert done.token_ids == [] and done.text == "" and done.finish_reason == "length"
    reference = reference_logprobs(model, prompt)
    scores = done.prompt_logprobs
    assert [entry.token for entry in scores] == prompt[1:]
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor([entry.logprob for entry in scores]), expected, atol=1e-4, rtol=0)
    for entry, row in zip(scores, reference, strict=False):
        assert [token for token, _ in entry.top] == row.topk(3).indices.tolist()
    assert engine.stats().blocks_used == 0  # a scored prompt gives its blocks back


def test_scoring_the_prompt_changes_nothing_generated_beside_it(engine_for):
    model = lively()
    engine = engine_for(model, kv_dtype="float32")
    batch = prompts(4)
    plain = run_all(engine, batch)
    streams = [engine.submit(p, dataclasses.replace(GREEDY, prompt_logprobs=0 if i % 2 else None))
               for i, p in enumerate(batch)]
    events = [list(stream) for stream in streams]
    assert [[t for e in ev for t in e.token_ids] for ev in events] == plain
    for i, (prompt, ev) in enumerate(zip(batch, events, strict=True)):
        scores = [e.prompt_logprobs for e in ev if e.prompt_logprobs is not None]
        if i % 2 == 0:
            assert scores == []
            continue
        assert len(scores) == 1 and ev[0].prompt_logprobs is scores[0]  # once, on the first event
        alone = engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0)).prompt_logprobs
        assert [e.token for e in scores[0]] == [e.token for e in alone] and all(e.top == () for e in alone)
        # The LM head's product over another number of rows may round differently: close, not bit for bit.
        torch.testing.assert_close([e.logprob for e in scores[0]], [e.logprob for e in alone], atol=1e-5, rtol=0)


def test_max_tokens_zero_needs_prompt_logprobs(engine_for):
    engine = engine_for(lively())
    with pytest.raises(RequestError, match="0 only to score the prompt") as error:
        engine.submit([5, 6, 7], SamplingParams(max_tokens=0))
    assert error.value.param == "max_tokens"
    with pytest.raises(RequestError) as error:
        engine.submit([5, 6, 7], SamplingParams(prompt_logprobs=21))
    assert error.value.param == "prompt_logprobs"


def test_several_prompts_are_queued_together_or_not_at_all(engine_for):
    engine = engine_for(lively(), max_running=1, max_queue=3)
    batch = prompts(3)
    groups = engine.submit_prompts(batch, GREEDY, 1)
    assert [[t for e in group[0] for t in e.token_ids] for group in groups] == run_all(engine, batch)
    with pytest.raises(RequestError, match=r"3 prompts x n=2 completions can never be queued") as error:
        engine.submit_prompts(batch, GREEDY, 2)
    assert error.value.param == "prompt"
    with pytest.raises(RequestError, match=r"^prompt 1: token id 999 is outside") as error:
        engine.submit_prompts([[5, 6], [7, 999]], GREEDY)
    assert error.value.param == "prompt"
    assert engine.stats().waiting == 0 and engine.stats().running == 0  # the first prompt was not queued either


def test_kernels_and_native_steps_are_ready_before_the_first_request(engine_for, monkeypatch):
    """Every bucket a step can reach is chosen and built when the engine starts, none while requests wait; the
    head only up to the rows it reads (one a running sequence)."""
    w8a8 = parse_scheme("w8a8")
    model = lq.quantize(family_model("llama"), RTN(), Plan([Rule("lm_head", w8a8), Rule(".*", w8a8)]), progress=False)
    engine = engine_for(model, max_running=4, prefill_chunk=16)  # steps of at most 20 rows: buckets 1, 16, 128
    threads = torch.get_num_threads()
    steps = set(engine.decoder._steps)
    assert steps == {(bucket, threads, False) for bucket in (1, 16, 128)}
    assert all(step is not None for step in engine.decoder._steps.values())
    blocks = [m for name, m in model.named_modules() if isinstance(m, lq.QuantLinear) and "layers" in name]
    assert blocks and all(set(layer.chosen_kernels()) == {1, 16, 128} for layer in blocks if layer.shared is None)
    assert set(model.lm_head.chosen_kernels()) == {1, 16}
    run_all(engine, prompts(4))
    assert set(engine.decoder._steps) == steps  # nothing more was built while serving


def test_what_the_kernels_that_lost_prepared_is_dropped_at_start(engine_for, monkeypatch):
    """The timing prepares every candidate (repacked copies of the codes for some); once every bucket is chosen,
    a layer keeps only what its chosen kernels read."""
    monkeypatch.setenv("LLMEASYQUANT_KERNEL_CHOICE", "measured")
    model = lq.quantize(family_model("llama"), RTN(), parse_scheme("w4a16-g32"), progress=False)
    engine_for(model, max_running=2, prefill_chunk=16)
    layers = [m for m in model.modules() if isinstance(m, lq.QuantLinear)]
    layers += [m.shared[0].combined for m in layers if m.shared is not None]
    timed = [layer for layer in layers if layer._kernels]
    assert timed
    for layer in timed:
        assert set(layer._prepared) == {kernel.name for kernel in layer._kernels.values()}
