"""The sampling math: logit_bias and the presence/frequency penalties change the logits exactly as OpenAI defines
them, log probabilities are a log-softmax of those logits (before temperature, top-k and top-p), the plain path is
untouched, and SamplingParams.check names the field of every value out of range."""

from __future__ import annotations

import math

import pytest
import torch

from llmeasyquant.runtime.requests import MAX_BIAS_ENTRIES, RequestError, SamplingParams
from llmeasyquant.runtime.sampling import RequestSampler, sample, token_logprob

VOCAB = 50


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_log_softmax(logits: torch.Tensor) -> list[float]:
    """log(exp(x_i) / sum_j exp(x_j)) in float64, written out (not torch's log_softmax)."""
    values = logits.double().tolist()
    top = max(values)
    total = sum(math.exp(v - top) for v in values)
    return [v - top - math.log(total) for v in values]


def test_bias_and_penalties_change_the_logits_as_specified() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.7,
                            logit_bias={3: 5.0, 7: -100.0, 9: 1.5})
    sampler = RequestSampler(params, VOCAB, None)
    generated = [3, 3, 9, 12, 3, 40]
    for token in generated:
        sampler.count(token)
    logits = logits_row()
    shaped = sampler.shape(logits)
    bias = {3: 5.0, 7: -100.0, 9: 1.5}
    for token in range(VOCAB):
        count = generated.count(token)
        expected = logits[token].item() + bias.get(token, 0.0) - 0.5 * (count > 0) - 0.7 * count
        assert shaped[token].item() == pytest.approx(expected, abs=1e-4), token
    untouched = [t for t in range(VOCAB) if t not in bias and t not in generated]
    assert torch.equal(shaped[untouched], logits[untouched])  # the rest exactly as the model gave them
    assert torch.equal(logits, logits_row())  # the step's logits are not written to


def test_negative_penalties_favour_repeats() -> None:
    sampler = RequestSampler(SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-0.25),
                             VOCAB, None)
    for token in (4, 4):
        sampler.count(token)
    logits = logits_row()
    assert sampler.shape(logits)[4].item() == pytest.approx(logits[4].item() + 1.0 + 0.5, abs=1e-5)


def test_greedy_choice_follows_bias_and_penalties() -> None:
    logits = torch.zeros(VOCAB)
    logits[0], logits[1] = 2.0, 1.9
    assert RequestSampler(SamplingParams(temperature=0.0, logit_bias={8: 2.5}), VOCAB, None).next(logits)[0] == 8
    assert RequestSampler(SamplingParams(temperature=0.0, logit_bias={0: -100}), VOCAB, None).next(logits)[0] == 1
    penalised = RequestSampler(SamplingParams(temperature=0.0, frequency_penalty=0.2), VOCAB, None)
    # 0 first; then 0 has lost 0.2 and 1 leads; then both have lost 0.2 and 0 leads again.
    assert [penalised.next(logits)[0] for _ in range(3)] == [0, 1, 0]
    logits[0], logits[1] = 1.5, 1.4
    present = RequestSampler(SamplingParams(temperature=0.0, presence_penalty=2.0), VOCAB, None)
    # Once generated, 0 and 1 fall below the untouched zeros, however often: 2 comes next, and again.
    assert [present.next(logits)[0] for _ in range(4)] == [0, 1, 2, 3]


def test_logprobs_equal_a_log_softmax_computed_apart() -> None:
    logits = logits_row(3)
    reference = reference_log_softmax(logits)
    entry = token_logprob(logits, 17, 5)
    assert entry.token == 17 and entry.logprob == pytest.approx(reference[17], abs=1e-5)
    ids = [token for token, _ in entry.top]
    assert ids == sorted(range(VOCAB), key=lambda t: -reference[t])[:5]  # the 5 likeliest, likeliest first
    assert [value for _, value in entry.top] == pytest.approx([reference[t] for t in ids], abs=1e-5)
    assert all(a >= b for (_, a), (_, b) in zip(entry.top, entry.top[1:], strict=False))
    assert token_logprob(logits, 17, 0).top == ()
    assert len(token_logprob(logits, 17, 20).top) == 20


def test_logprobs_are_of_the_biased_logits_before_temperature_and_filters() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.5, seed=1, logit_bias={2: 4.0}, logprobs=3,
                            frequency_penalty=1.0)
    sampler = RequestSampler(params, VOCAB, torch.Generator().manual_seed(1))
    logits = logits_row(4)
    first, entry = sampler.next(logits)
    expected = logits.clone()
    expected[2] += 4.0
    reference = reference_log_softmax(expected)
    assert entry.logprob == pytest.approx(reference[first], abs=1e-5)  # not of logits / 0.5, nor top-k's
    assert [t for t, _ in entry.top] == sorted(range(VOCAB), key=lambda t: -reference[t])[:3]
    second, entry = sampler.next(logits)
    expected[first] -= 1.0  # the first token has been generated once
    assert entry.logprob == pytest.approx(reference_log_softmax(expected)[second], abs=1e-5)


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 10, "top_p": 0.8}])
def test_logprobs_alone_choose_the_tokens_the_plain_path_does(options: dict) -> None:
    plain = SamplingParams(seed=3, **options)
    asking = SamplingParams(seed=3, logprobs=2, **options)
    assert plain.plain and not asking.plain and not asking.shapes_logits
    plain_generator, asking_generator = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler = RequestSampler(asking, VOCAB, asking_generator)
    for step in range(20):
        logits = logits_row(step)
        assert sampler.next(logits)[0] == sample(logits, plain, plain_generator)


def test_a_plain_request_gets_no_sampler_state() -> None:
    sampler = RequestSampler(SamplingParams(logprobs=0), VOCAB, None)
    logits = logits_row()
    assert sampler.shape(logits) is logits and sampler.offset is None
    assert SamplingParams().plain and SamplingParams(presence_penalty=0.0, logit_bias={}).plain


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": -2.01}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": True}, "frequency_penalty", "[-2, 2]"),
    ({"logit_bias": {5: 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "'5'"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias", f"0..{VOCAB - 1}"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", f"0..{VOCAB - 1}"),
    ({"logit_bias": dict.fromkeys(range(MAX_BIAS_ENTRIES + 1), 1.0)}, "logit_bias", str(MAX_BIAS_ENTRIES)),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"logprobs": -1}, "logprobs", "[0, 20]"),
    ({"logprobs": True}, "logprobs", "[0, 20]"),
    ({"seed": 2**64}, "seed", "2**64"),
]


@pytest.mark.parametrize(("options", "param", "words"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_check_names_the_field_out_of_range(options: dict, param: str, words: str) -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(**options).check(VOCAB)
    assert error.value.param == param and error.value.status == 400
    assert words in str(error.value)


def test_check_takes_the_edges_of_each_range() -> None:
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, logit_bias={0: -100, VOCAB - 1: 100},
                   logprobs=20, seed=-(2**63)).check(VOCAB)
    SamplingParams(logit_bias=dict.fromkeys(range(MAX_BIAS_ENTRIES), 0.5), logprobs=0, seed=2**64 - 1).check()
    # Without the vocabulary size any integer key passes check(); the engine checks it against its vocabulary.
    SamplingParams(logit_bias={10**6: 1.0}).check()
